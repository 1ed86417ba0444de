//! Integer request fields read as vLLM's pydantic models read them: an integer, or a float with
//! no fractional part (`"max_tokens": 5.0` is 5). `5.5`, a string, or a value outside the field's
//! type is still an error.

use serde::de::Error;
use serde::{Deserialize, Deserializer};

/// `#[serde(default, deserialize_with = "whole_number::optional")]` on an `Option<integer>`.
pub fn optional<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<i64> + TryFrom<u64>,
{
    let Some(number) = Option::<serde_json::Number>::deserialize(deserializer)? else {
        return Ok(None);
    };
    let out_of_range = || D::Error::custom(format!("{number} is out of range for this field"));
    if let Some(value) = number.as_u64() {
        return T::try_from(value).map(Some).map_err(|_| out_of_range());
    }
    if let Some(value) = number.as_i64() {
        return T::try_from(value).map(Some).map_err(|_| out_of_range());
    }
    let float = number.as_f64().expect("a JSON number is u64, i64 or f64");
    // Past 2^53 a float is no longer exact: an integer out of i64's range (which JSON parsing
    // turns into a float) must not round into it.
    const EXACT: f64 = 9_007_199_254_740_992.0;
    if float.fract() != 0.0 || float.abs() > EXACT {
        return Err(D::Error::custom(format!(
            "expected an integer, got {number}"
        )));
    }
    T::try_from(float as i64)
        .map(Some)
        .map_err(|_| out_of_range())
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    struct Fields {
        #[serde(default, deserialize_with = "super::optional")]
        count: Option<u32>,
        #[serde(default, deserialize_with = "super::optional")]
        seed: Option<i64>,
    }

    fn read(json: &str) -> Result<Fields, serde_json::Error> {
        serde_json::from_str(json)
    }

    #[test]
    fn integers_and_whole_floats_are_read() {
        let fields = read(r#"{"count": 5, "seed": -3}"#).unwrap();
        assert_eq!((fields.count, fields.seed), (Some(5), Some(-3)));
        let fields = read(r#"{"count": 5.0, "seed": -3.0}"#).unwrap();
        assert_eq!((fields.count, fields.seed), (Some(5), Some(-3)));
        let fields = read(r#"{"count": 1e3}"#).unwrap();
        assert_eq!(fields.count, Some(1000));
        let fields = read(r#"{"seed": -9223372036854775808, "count": 4294967295.0}"#).unwrap();
        assert_eq!(
            (fields.count, fields.seed),
            (Some(u32::MAX), Some(i64::MIN))
        );
        let fields = read(r#"{"count": null}"#).unwrap();
        assert_eq!((fields.count, fields.seed), (None, None));
        assert_eq!(read("{}").unwrap().count, None);
    }

    #[test]
    fn fractions_strings_and_out_of_range_values_are_errors() {
        for json in [
            r#"{"count": 5.5}"#,
            r#"{"count": "5"}"#,
            r#"{"count": -1}"#,
            r#"{"count": -1.0}"#,
            r#"{"count": 4294967296}"#,
            r#"{"count": 1e300}"#,
            r#"{"seed": 9.3e18}"#,
            r#"{"seed": 18446744073709551615}"#,
            r#"{"seed": -9223372036854775809}"#,
            r#"{"seed": 9007199254740994.0}"#,
        ] {
            let error = read(json).unwrap_err().to_string();
            assert!(
                error.contains("integer")
                    || error.contains("range")
                    || error.contains("invalid type"),
                "{json}: {error}"
            );
        }
    }
}
