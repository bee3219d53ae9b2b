//! Secrets live outside the config file and never reach a log line, an error message or
//! `/readyz`. A config file refers to a secret as `${NAME}` (an environment variable) or
//! `${file:PATH}` (a file, such as a mounted Kubernetes secret), in any string value; the
//! database URL can come from a file with `DATABASE_URL_FILE`. Whatever prints a URL passes
//! it through [`redact_url`] first.

use std::path::Path;

/// `value` with every `${NAME}` replaced by the environment variable NAME and every
/// `${file:PATH}` by the file's contents (without its trailing newline); `$${` is a literal
/// `${`. An unset variable or unreadable file is an error naming it.
pub fn interpolate(value: &str) -> Result<String, String> {
    interpolate_with(value, |name| std::env::var(name).ok())
}

/// [`interpolate`] with the environment given as a lookup.
pub fn interpolate_with(
    value: &str,
    env: impl Fn(&str) -> Option<String>,
) -> Result<String, String> {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(start) = rest.find('$') {
        out.push_str(&rest[..start]);
        let after = &rest[start..];
        if let Some(tail) = after.strip_prefix("$${") {
            out.push_str("${");
            rest = tail;
        } else if let Some(tail) = after.strip_prefix("${") {
            let end = tail
                .find('}')
                .ok_or_else(|| format!("unterminated ${{ in {:?}", preview(value)))?;
            let reference = &tail[..end];
            match reference.strip_prefix("file:") {
                Some(path) => out.push_str(&read_secret_file(Path::new(path))?),
                None => {
                    let valid = !reference.is_empty()
                        && !reference.starts_with(|c: char| c.is_ascii_digit())
                        && reference
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_');
                    if !valid {
                        return Err(format!(
                            "${{{reference}}} is neither ${{NAME}} (an environment variable) \
                             nor ${{file:PATH}}"
                        ));
                    }
                    out.push_str(
                        &env(reference).ok_or_else(|| {
                            format!("environment variable {reference} is not set")
                        })?,
                    );
                }
            }
            rest = &tail[end + 1..];
        } else {
            out.push('$');
            rest = &after[1..];
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// A secret file's contents without the trailing newline an editor or `echo` leaves.
pub fn read_secret_file(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read secret file {}: {e}", path.display()))?;
    Ok(text.trim_end_matches(['\n', '\r']).to_owned())
}

/// Where a value with no secret in it starts, for an error message: the text up to the
/// first `${`, which is what the user wrote rather than what it expanded to.
fn preview(value: &str) -> &str {
    value.split("${").next().unwrap_or_default()
}

/// The URL with any password replaced by `***`, for logs and error messages.
pub fn redact_url(url: &str) -> String {
    // scheme://user:secret@host/… → scheme://user:***@host/…
    let mut out = match url.split_once("://") {
        Some((scheme, rest)) => match rest.split_once('@') {
            Some((userinfo, host)) if !userinfo.contains('/') => match userinfo.split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
                None => url.to_owned(),
            },
            _ => url.to_owned(),
        },
        None => url.to_owned(),
    };
    // key=value form and ?password= query parameters
    for marker in ["password=", "PASSWORD="] {
        while let Some(start) = out.find(marker) {
            let value_start = start + marker.len();
            if out[value_start..].starts_with("***") {
                break;
            }
            let value_end = out[value_start..]
                .find(['&', ' '])
                .map_or(out.len(), |i| value_start + i);
            out.replace_range(value_start..value_end, "***");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_and_files_are_substituted_and_missing_ones_named() {
        let env = |name: &str| (name == "PW").then(|| "s3cret".to_owned());
        assert_eq!(
            interpolate_with("nats://relay:${PW}@h:4222", env).unwrap(),
            "nats://relay:s3cret@h:4222"
        );
        assert_eq!(
            interpolate_with("cost $5, $${PW}", env).unwrap(),
            "cost $5, ${PW}"
        );
        let dir = std::env::temp_dir().join(format!("outbox-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "from-file\n").unwrap();
        assert_eq!(
            interpolate_with(&format!("Bearer ${{file:{}}}", file.display()), env).unwrap(),
            "Bearer from-file"
        );
        let e = interpolate_with("${MISSING}", env).unwrap_err();
        assert_eq!(e, "environment variable MISSING is not set");
        let e = interpolate_with("${file:/nonexistent/x}", env).unwrap_err();
        assert!(
            e.starts_with("cannot read secret file /nonexistent/x"),
            "{e}"
        );
        let e = interpolate_with("a${PW", env).unwrap_err();
        assert!(e.contains("unterminated"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn redacts_passwords_in_every_url_form() {
        assert_eq!(
            redact_url("postgres://relay:s3cret@db:5432/app"),
            "postgres://relay:***@db:5432/app"
        );
        assert_eq!(
            redact_url("postgres://db/app?user=relay&password=s3cret&sslmode=require"),
            "postgres://db/app?user=relay&password=***&sslmode=require"
        );
        assert_eq!(
            redact_url("host=db user=relay password=s3cret dbname=app"),
            "host=db user=relay password=*** dbname=app"
        );
        assert_eq!(
            redact_url("postgres://relay@db/app"),
            "postgres://relay@db/app"
        );
        assert_eq!(
            redact_url("nats://relay:pw@127.0.0.1:4222"),
            "nats://relay:***@127.0.0.1:4222"
        );
    }
}
