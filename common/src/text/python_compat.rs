//! What transformers' chat templates call from Python, done here as Python does it: `tojson` (Python's
//! `json.dumps`) and `strftime_now` (`datetime.now().strftime`). The chat template registers them.

use std::io;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::Kwargs;
use minijinja::{ErrorKind, Value};
use serde::Serialize;

/// Python's `json.dumps(value, ensure_ascii=False)` as transformers' `tojson`
/// calls it: `", "` and `": "` separators, or pretty-printing with `indent`.
/// Messages keep their field order (role, content) like Python dicts, but maps
/// written in a template are ordered by key, so `sort_keys` is accepted and ignored.
pub(crate) fn python_tojson(value: &Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent = kwargs.get::<Option<usize>>("indent")?;
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let separators = kwargs.get::<Option<Vec<String>>>("separators")?;
    let _sort_keys = kwargs.get::<Option<bool>>("sort_keys")?;
    kwargs.assert_all_used()?;

    let (item_separator, key_separator) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson separators must be two strings",
            ))
        }
        // Python drops the space after commas when indenting: it would trail each line.
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let formatter = PythonJsonFormatter {
        indent: indent.map(|width| " ".repeat(width)),
        item_separator,
        key_separator,
        ensure_ascii,
        depth: 0,
        has_value: false,
    };
    let mut out = Vec::new();
    let mut serializer = serde_json::Serializer::with_formatter(&mut out, formatter);
    value.serialize(&mut serializer).map_err(|error| {
        minijinja::Error::new(ErrorKind::BadSerialization, "tojson failed").with_source(error)
    })?;
    let json = String::from_utf8(out).expect("serde_json writes UTF-8");
    Ok(Value::from_safe_string(json))
}

struct PythonJsonFormatter {
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    ensure_ascii: bool,
    depth: usize,
    /// Whether the container being written has an element (an empty one stays on one line).
    has_value: bool,
}

impl PythonJsonFormatter {
    fn write_line_break<W: ?Sized + io::Write>(&self, writer: &mut W) -> io::Result<()> {
        if let Some(indent) = &self.indent {
            writer.write_all(b"\n")?;
            for _ in 0..self.depth {
                writer.write_all(indent.as_bytes())?;
            }
        }
        Ok(())
    }

    fn begin_container<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        open: &[u8],
    ) -> io::Result<()> {
        self.depth += 1;
        self.has_value = false;
        writer.write_all(open)
    }

    fn end_container<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        close: &[u8],
    ) -> io::Result<()> {
        self.depth -= 1;
        if self.has_value {
            self.write_line_break(writer)?;
        }
        writer.write_all(close)
    }

    fn begin_element<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if !first {
            writer.write_all(self.item_separator.as_bytes())?;
        }
        self.write_line_break(writer)
    }
}

impl serde_json::ser::Formatter for PythonJsonFormatter {
    fn begin_array<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.begin_container(writer, b"[")
    }

    fn end_array<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.end_container(writer, b"]")
    }

    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.begin_element(writer, first)
    }

    fn end_array_value<W: ?Sized + io::Write>(&mut self, _writer: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.begin_container(writer, b"{")
    }

    fn end_object<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        self.end_container(writer, b"}")
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.begin_element(writer, first)
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        writer.write_all(self.key_separator.as_bytes())
    }

    fn end_object_value<W: ?Sized + io::Write>(&mut self, _writer: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn write_string_fragment<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> io::Result<()> {
        if !self.ensure_ascii {
            return writer.write_all(fragment.as_bytes());
        }
        for ch in fragment.chars() {
            if ch.is_ascii() {
                writer.write_all(&[ch as u8])?;
            } else {
                let mut units = [0u16; 2];
                for unit in ch.encode_utf16(&mut units) {
                    write!(writer, "\\u{unit:04x}")?;
                }
            }
        }
        Ok(())
    }
}

/// Python's `datetime.now().strftime(format)` for the directives chat templates
/// use (dates in system prompts), in UTC.
pub(crate) fn strftime_now(format: String) -> Result<Value, minijinja::Error> {
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_secs())
        .unwrap_or(0);
    formatted_time(&format, seconds).map(Value::from)
}

fn formatted_time(format: &str, unix_seconds: u64) -> Result<String, minijinja::Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const WEEKDAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = (unix_seconds / 86_400) as i64;
    let seconds_of_day = unix_seconds % 86_400;
    let (year, month, day) = civil_date(days);
    // 1970-01-01 was a Thursday (index 3 counting from Monday).
    let weekday = WEEKDAYS[((days + 3) % 7) as usize];
    let month_name = MONTHS[(month - 1) as usize];

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(ch) = chars.next() {
        if ch != '%' {
            out.push(ch);
            continue;
        }
        let directive = chars.next();
        // `%-d` is glibc's unpadded form, which Python on Linux passes through.
        let unpadded = directive == Some('-');
        let directive = if unpadded { chars.next() } else { directive };
        let number = |value: u64, width: usize| {
            if unpadded {
                value.to_string()
            } else {
                format!("{value:0width$}")
            }
        };
        match directive {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&number((year % 100) as u64, 2)),
            Some('m') => out.push_str(&number(month, 2)),
            Some('d') => out.push_str(&number(day, 2)),
            Some('H') => out.push_str(&number(seconds_of_day / 3600, 2)),
            Some('M') => out.push_str(&number(seconds_of_day / 60 % 60, 2)),
            Some('S') => out.push_str(&number(seconds_of_day % 60, 2)),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('%') => out.push('%'),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.unwrap_or(' ')
                    ),
                ))
            }
        }
    }
    Ok(out)
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01, by Howard
/// Hinnant's days-to-civil algorithm over 400-year eras.
fn civil_date(days_since_epoch: i64) -> (i64, u64, u64) {
    let shifted = days_since_epoch + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_from_march + 2) / 5 + 1) as u64;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    } as u64;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_dates_like_python() {
        // 2024-02-29T13:05:09Z, a Thursday.
        let leap_day = 1_709_211_909;
        assert_eq!(
            formatted_time("%d %b %Y %H:%M:%S %A %-d %B %y %%", leap_day).unwrap(),
            "29 Feb 2024 13:05:09 Thursday 29 February 24 %"
        );
        assert_eq!(formatted_time("%Y-%m-%d", 0).unwrap(), "1970-01-01");
        assert!(formatted_time("%Q", 0).is_err());
    }
}
