//! The API key: where it comes from (a flag, `SLUICE_API_KEY`, or a file) and the one check that
//! every protected route of the frontend and of the router runs.

use std::path::Path;

use axum::http::{header, HeaderMap};
use subtle::ConstantTimeEq;

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    /// No key, or a key that is not the one expected.
    Wrong,
    /// More than one `Authorization` (or `x-api-key`) header: which one a proxy would read is
    /// anyone's guess.
    Duplicate,
}

/// Anthropic's clients send the key in this header instead of `Authorization`.
pub const X_API_KEY: &str = "x-api-key";

/// Checks that `headers` carry the key: `Authorization: Bearer <expected>` (OpenAI's clients) or
/// `x-api-key: <expected>` (Anthropic's), each at most once; a request that sends both must send
/// the key in both. Compared in constant time (only its length can be told from the timing).
/// Nothing is trimmed.
pub fn authorize(expected: &str, headers: &HeaderMap) -> Result<(), AuthFailure> {
    let bearer = single(headers, header::AUTHORIZATION.as_str())?
        .map(|value| value.strip_prefix(b"Bearer ").ok_or(AuthFailure::Wrong))
        .transpose()?;
    let x_api_key = single(headers, X_API_KEY)?;
    let given: Vec<&[u8]> = bearer.into_iter().chain(x_api_key).collect();
    let matches = |key: &&[u8]| bool::from(key.ct_eq(expected.as_bytes()));
    if !given.is_empty() && given.iter().all(matches) {
        Ok(())
    } else {
        Err(AuthFailure::Wrong)
    }
}

/// The value of a header that may come at most once.
fn single<'a>(headers: &'a HeaderMap, name: &str) -> Result<Option<&'a [u8]>, AuthFailure> {
    let mut values = headers.get_all(name).iter();
    let value = values.next().map(|value| value.as_bytes());
    if values.next().is_some() {
        return Err(AuthFailure::Duplicate);
    }
    Ok(value)
}

/// The key to require: `--api-key-file`'s contents (one trailing newline removed), else
/// `--api-key` or `SLUICE_API_KEY` (clap reads both into `flag`), else none.
pub fn load_api_key(flag: Option<String>, file: Option<&Path>) -> Result<Option<String>, String> {
    let key = match (flag, file) {
        (Some(_), Some(_)) => {
            return Err(
                "give the API key once: --api-key (or SLUICE_API_KEY) or --api-key-file".into(),
            )
        }
        (Some(key), None) => key,
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path).map_err(|error| {
                format!("cannot read --api-key-file {}: {error}", path.display())
            })?;
            let text = text.strip_suffix('\n').unwrap_or(&text);
            text.strip_suffix('\r').unwrap_or(text).to_owned()
        }
        (None, None) => return Ok(None),
    };
    check_api_key_text(&key)?;
    Ok(Some(key))
}

/// A key must be something a client can send in a header unchanged: visible ASCII, no spaces.
fn check_api_key_text(key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("the API key is empty".into());
    }
    if !key.bytes().all(|byte| byte.is_ascii_graphic()) {
        return Err("the API key must be visible ASCII without spaces".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[test]
    fn only_the_exact_bearer_key_passes() {
        assert_eq!(authorize("k3y", &headers(&["Bearer k3y"])), Ok(()));
        for bad in [
            &[][..],
            &["Bearer k3"],
            &["Bearer k3yy"],
            &["Bearer  k3y"],
            &["Bearer k3y "],
            &["bearer k3y"],
            &["Basic k3y"],
            &["k3y"],
            &["Bearer "],
        ] {
            assert_eq!(
                authorize("k3y", &headers(bad)),
                Err(AuthFailure::Wrong),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_second_authorization_header_is_refused_even_if_one_is_right() {
        for pair in [["Bearer k3y", "Bearer x"], ["Bearer x", "Bearer k3y"]] {
            assert_eq!(
                authorize("k3y", &headers(&pair)),
                Err(AuthFailure::Duplicate)
            );
        }
    }

    fn x_api_key(values: &[&str], bearer: &[&str]) -> HeaderMap {
        let mut headers = headers(bearer);
        for value in values {
            headers.append(X_API_KEY, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[test]
    fn anthropic_clients_send_the_key_as_x_api_key() {
        assert_eq!(authorize("k3y", &x_api_key(&["k3y"], &[])), Ok(()));
        assert_eq!(
            authorize("k3y", &x_api_key(&["k3y"], &["Bearer k3y"])),
            Ok(())
        );
        for (keys, bearer) in [
            (&["Bearer k3y"][..], &[][..]),
            (&["k3"], &[]),
            (&[""], &[]),
            // Both given: both must hold the key.
            (&["k3y"], &["Bearer x"]),
            (&["x"], &["Bearer k3y"]),
        ] {
            assert_eq!(
                authorize("k3y", &x_api_key(keys, bearer)),
                Err(AuthFailure::Wrong),
                "{keys:?} {bearer:?}"
            );
        }
        assert_eq!(
            authorize("k3y", &x_api_key(&["k3y", "k3y"], &[])),
            Err(AuthFailure::Duplicate)
        );
    }

    #[test]
    fn a_key_file_loses_one_trailing_newline_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("sluice-auth-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("key");
        for (text, expected) in [("abc\n", "abc"), ("abc\r\n", "abc"), ("abc", "abc")] {
            std::fs::write(&file, text).unwrap();
            assert_eq!(load_api_key(None, Some(&file)), Ok(Some(expected.into())));
        }
        for bad in [" abc\n", "abc\n\n", "a c", ""] {
            std::fs::write(&file, bad).unwrap();
            assert!(load_api_key(None, Some(&file)).is_err(), "{bad:?}");
        }
        assert!(load_api_key(Some("abc".into()), Some(&file)).is_err());
        assert_eq!(load_api_key(None, None), Ok(None));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
