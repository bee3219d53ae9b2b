//! The console in a real browser: `tests/browser/console.mjs` drives Debian's Chromium with
//! playwright-core (npm) against the built binary and a database seeded here, checking
//! what only a browser shows (console errors, the CSP, forms, live updates, axe-core's
//! accessibility rules). `scripts/test-services.sh` installs Chromium (apt) and
//! playwright-core and axe-core (npm, into the target directory); without them this test
//! fails naming that script, never passes untried. The screenshots it saves are the ones
//! docs/console.md shows, saved in `target/console-screenshots/`; with
//! `UPDATE_CONSOLE_SCREENSHOTS=1` a passing run also writes them into `docs/console/` (as
//! `UPDATE_SQL_API_DOC=1` regenerates docs/sql-api.md).

use crate::common;
use crate::console::{Console, TOKEN, seed};

use common::{TestDb, text};

#[tokio::test(flavor = "multi_thread")]
async fn the_console_works_in_chromium_without_errors_or_serious_accessibility_violations() {
    let target = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target directory")
        .to_owned();
    let modules = target.join("node_modules");
    let chromium = ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists());
    assert!(
        modules.join("playwright-core").is_dir()
            && modules.join("axe-core").is_dir()
            && chromium.is_some(),
        "the browser suite needs Chromium and playwright-core and axe-core under {}: run \
         scripts/test-services.sh (make test does)",
        modules.display()
    );
    let db = TestDb::new().await;
    let (message, dead) = seed(&db.client().await).await;
    let console = Console::start(&db, &db.url, Some(TOKEN), &["--refresh", "1s"]).await;
    // Outside the test's scratch directory, which goes with its database when it passes.
    let shots = target.join("console-screenshots");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/browser/console.mjs");
    let out = tokio::task::spawn_blocking({
        let (db_url, name, shots) = (db.url.clone(), db.name.clone(), shots.clone());
        let chromium = chromium.unwrap().to_owned();
        let port = console.port;
        move || {
            std::process::Command::new("node")
                .arg(script)
                .env("NODE_MODULES", &modules)
                .env("CHROMIUM", chromium)
                .env("CONSOLE", format!("http://127.0.0.1:{port}"))
                .env("SOURCE", name)
                .env("MESSAGE", message.to_string())
                .env("DEAD", format!("{},{}", dead[0], dead[1]))
                .env("TOKEN", TOKEN)
                .env("SCREENSHOTS", shots)
                .env("OUTBOX_RELAY", env!("CARGO_BIN_EXE_outbox-relay"))
                .env("DATABASE_URL", db_url)
                .output()
                .expect("run node")
        }
    })
    .await
    .unwrap();
    let report = format!(
        "{}{}\nconsole log:\n{}",
        text(&out.stdout),
        text(&out.stderr),
        console.log_text()
    );
    assert!(out.status.success(), "{report}");
    assert!(report.contains("every browser check passed"), "{report}");
    for shot in [
        "overview",
        "messages",
        "message",
        "dead-letters",
        "sources",
        "destinations",
    ] {
        assert!(
            shots.join(format!("{shot}.png")).is_file(),
            "{shot}.png: {report}"
        );
    }
    if std::env::var("UPDATE_CONSOLE_SCREENSHOTS").is_ok_and(|v| v == "1") {
        let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/console");
        for shot in std::fs::read_dir(&shots).expect("read the screenshots") {
            let shot = shot.expect("a screenshot").path();
            if shot.extension().is_some_and(|e| e == "png") {
                let to = docs.join(shot.file_name().expect("a file name"));
                std::fs::copy(&shot, &to)
                    .unwrap_or_else(|e| panic!("copy {} to {}: {e}", shot.display(), to.display()));
                println!("wrote {}", to.display());
            }
        }
    }
    println!("{report}\nscreenshots in {}", shots.display());
}
