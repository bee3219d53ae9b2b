//! What the command line says about itself outside `--help`: shell completion scripts and
//! manual pages, generated from the same clap definitions as the parser so that they cannot
//! drift from it. The generators are clap's own (clap_complete, clap_mangen); this module
//! mends what they get wrong for this binary and adds the sections a manual needs that clap
//! does not know about (the configuration file, the environment, the exit statuses).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{Context, Result, bail};
use clap::Command;

/// The completion script for `shell`.
pub fn completions(mut cmd: Command, shell: clap_complete::Shell) -> String {
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, BIN, &mut script);
    let script = String::from_utf8_lossy(&script).into_owned();
    match shell {
        clap_complete::Shell::Bash => mend_bash(&script),
        _ => script,
    }
}

const BIN: &str = "outbox-relay";

/// clap_complete names the bash state of a verb two ways when the binary's name has a
/// hyphen: the loop that walks the words sets `cmd` to `outbox__relay__subcmd__replay`,
/// while the arms that complete a verb are labelled `outbox__subcmd__relay__subcmd__replay`,
/// and an arm below the top level matches only when both spell the state the same: this
/// gives both one spelling.
fn mend_bash(script: &str) -> String {
    let walked = BIN.replace('-', "__");
    let labelled = BIN.replace('-', "__subcmd__");
    script.replace(&labelled, &walked)
}

/// The manual page of `verb` (`[]` for the top page, `["dead-letters", "list"]` for a
/// nested verb) as roff.
pub fn page(cmd: Command, verb: &[String]) -> Result<String> {
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    let top = verb.is_empty();
    let mut found = cmd.clone();
    for (depth, name) in verb.iter().enumerate() {
        let Some(sub) = found.find_subcommand(name).cloned() else {
            let known: Vec<&str> = found.get_subcommands().map(Command::get_name).collect();
            bail!(
                "no manual page for `{}`: {} has the verbs {}",
                verb[..=depth].join(" "),
                if depth == 0 {
                    BIN.to_owned()
                } else {
                    format!("{BIN} {}", verb[..depth].join(" "))
                },
                known.join(", ")
            );
        };
        found = sub;
    }
    render(&cmd, &found, top)
}

/// Writes every page (`outbox-relay.1`, `outbox-relay-run.1`, `outbox-relay-dead-letters-list.1`,
/// …) into `dir`; returns their paths.
pub fn write_all(cmd: Command, dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    let mut pages = Vec::new();
    let mut todo = vec![(cmd.clone(), true)];
    while let Some((c, top)) = todo.pop() {
        todo.extend(c.get_subcommands().map(|s| (s.clone(), false)));
        let man = clap_mangen::Man::new(c.clone());
        let path = dir.join(man.get_filename());
        std::fs::write(&path, render(&cmd, &c, top)?)
            .with_context(|| format!("writing {}", path.display()))?;
        pages.push(path);
    }
    pages.sort();
    Ok(pages)
}

/// One page: clap_mangen's sections, then SEE ALSO naming the other pages; the top page
/// also has FILES, ENVIRONMENT and EXIT STATUS.
fn render(root: &Command, cmd: &Command, top: bool) -> Result<String> {
    let mut out = Vec::new();
    clap_mangen::Man::new(cmd.clone())
        .source(format!("{BIN} {}", env!("CARGO_PKG_VERSION")))
        .render(&mut out)?;
    let mut page = String::from_utf8(out)?;
    if top {
        page += &files_section();
        page += &environment_section(root);
        page += EXIT_STATUS;
    }
    page += &see_also(cmd, top);
    Ok(page)
}

fn files_section() -> String {
    format!(
        ".SH FILES\n\
         .TP\n\
         \\fIPATH\\fR given with \\fB\\-\\-config\\fR or \\fBOUTBOX_CONFIG\\fR\n\
         A TOML file of settings: the \\fBrun\\fR flags in snake_case (\\fBbatch_size = 500\\fR), \
         plus \\fBdatabase_url\\fR, destination tables (\\fB[destinations.NAME]\\fR) and routes \
         (\\fB[[routes]]\\fR). Flags and environment variables override it; unknown keys are \
         refused naming the key. A string value may refer to a secret as \\fB${{NAME}}\\fR (an \
         environment variable) or \\fB${{file:PATH}}\\fR (a file such as a mounted secret). See \
         \\fB{BIN}\\-run\\fR(1) for every setting and its default.\n"
    )
}

/// Every variable the parser reads, with the option it stands for, plus the ones read
/// outside clap.
fn environment_section(root: &Command) -> String {
    let mut flags: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut todo = vec![root.clone()];
    while let Some(c) = todo.pop() {
        todo.extend(c.get_subcommands().cloned());
        for arg in c.get_arguments() {
            if let (Some(env), Some(long)) = (arg.get_env(), arg.get_long()) {
                flags
                    .entry(env.to_string_lossy().into_owned())
                    .or_default()
                    .insert(format!("\\fB\\-\\-{}\\fR", roff_escape(long)));
            }
        }
    }
    let mut vars: BTreeMap<String, String> = flags
        .into_iter()
        .map(|(env, longs)| {
            let longs: Vec<String> = longs.into_iter().collect();
            (env, format!("Same as {}.", longs.join(" or ")))
        })
        .collect();
    for (name, what) in [
        (
            "OUTBOX_DATABASE_URL_FILE",
            "Same as \\fB\\-\\-database\\-url\\-file\\fR.",
        ),
        (
            "PGSSLMODE, PGSSLROOTCERT, PGSSLCERT, PGSSLKEY, PGSSLNEGOTIATION, PGPASSWORD",
            "libpq's variables fill what the database URL leaves out.",
        ),
        (
            "RUST_LOG",
            "Filters the log (default \\fBinfo\\fR), e.g. \\fBRUST_LOG=outbox_relay=debug\\fR.",
        ),
    ] {
        vars.insert(name.to_owned(), what.to_owned());
    }
    let mut s = String::from(".SH ENVIRONMENT\n");
    for (name, what) in vars {
        s += &format!(".TP\n\\fB{}\\fR\n{what}\n", roff_escape(&name));
    }
    s
}

const EXIT_STATUS: &str = ".SH \"EXIT STATUS\"\n\
.TP\n\\fB0\\fR\nThe verb did what was asked.\n\
.TP\n\\fB2\\fR\nAn error, named on standard error: bad arguments or settings, the database \
unreachable or its schema not the one this build needs, \\fBreplay \\-\\-id\\fR naming \
messages that are not dead letters, \\fBhealthcheck\\fR answered other than 200; with \
\\fB\\-\\-all\\-sources\\fR, a source that failed (every source is tried first, the \
ones that failed are named).\n\
.TP\n\\fB130\\fR\n\\fBrun\\fR received a second SIGINT or SIGTERM and exited without \
finishing in\\-flight deliveries.\n\
.TP\n\\fB141\\fR\nThe reader of standard output went away (\\fBstatus \\-\\-json | head \
\\-1\\fR), as a tool killed by SIGPIPE.\n";

/// The top page (from a verb's page) and the pages of `cmd`'s own verbs.
fn see_also(cmd: &Command, top: bool) -> String {
    let mut names: Vec<&str> = Vec::new();
    if !top {
        names.push(BIN);
    }
    names.extend(
        cmd.get_subcommands()
            .map(|s| s.get_display_name().unwrap_or(s.get_name())),
    );
    if names.is_empty() {
        return String::new();
    }
    let refs: Vec<String> = names
        .iter()
        .map(|n| format!("\\fB{}\\fR(1)", roff_escape(n)))
        .collect();
    format!(".SH \"SEE ALSO\"\n{}\n", refs.join(", "))
}

fn roff_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('-', "\\-")
}
