//! Standard output of the verbs, written as Unix tools write it. `print!` and `println!`
//! panic when a write fails (exit 101 with a backtrace): when the reader went away
//! (`outbox-relay status --json | head -1`) the verb here ends quietly with status 141, as
//! `cat` or `grep` killed by SIGPIPE do (128 + 13); any other failure, such as a full disk,
//! ends it with an error naming the problem and status 2, the verbs' error status.

use std::io::Write;

/// Writes `args` to standard output and flushes, or ends the process as described above.
pub fn write(args: std::fmt::Arguments<'_>) {
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_fmt(args).and_then(|()| stdout.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(141);
        }
        eprintln!("error: writing to standard output: {e}");
        std::process::exit(2);
    }
}

/// `print!` for the verbs (see the module docs).
macro_rules! out {
    ($($arg:tt)*) => { $crate::output::write(format_args!($($arg)*)) };
}

/// `println!` for the verbs (see the module docs).
macro_rules! outln {
    () => { $crate::output::write(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::output::write(format_args!("{}\n", format_args!($($arg)*))) };
}
