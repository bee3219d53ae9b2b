//! Rebuilds the embedded migrations when a file under `schema/migrations/` is added or changed.
fn main() {
    println!("cargo:rerun-if-changed=schema/migrations");
}
