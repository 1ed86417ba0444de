//! Pieces of the parsers' lazy grammars (llguidance's Lark): free text that never holds a call's
//! opening, text that ends at it, and sequences of a tool's parameters.

use serde_json::Value;

/// `text` as a Lark string literal (JSON's quoting, which llguidance reads).
pub fn literal(text: &str) -> String {
    Value::String(text.into()).to_string()
}

/// `text` matched literally inside a `/.../` regex.
pub fn regex_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for ch in text.chars() {
        if "\\.+*?()|[]{}^$/-".contains(ch) {
            escaped.push('\\');
        }
        escaped.push(ch);
    }
    escaped
}

/// A regex of any text that holds `text`.
pub fn holding(text: &str) -> String {
    format!("(?s:.*{}.*)", regex_escape(text))
}

/// `TEXT`: free text that matches none of the regexes `not` (the ways an output opens a call).
pub fn free_text(not: &[String]) -> String {
    format!("TEXT: {}\n", text_but(not))
}

/// `prefix`: text that ends at (and holds nothing of) `marker`, which llguidance's `stop` takes,
/// and matches none of the regexes `not`.
pub fn prefix(marker: &str, not: &[String]) -> String {
    format!("prefix[stop={}]: {}\n", literal(marker), text_but(not))
}

fn text_but(not: &[String]) -> String {
    let mut text = String::from("/(?s:.*)/");
    for regex in not {
        text.push_str(&format!(" & ~/{regex}/"));
    }
    text
}

/// The rules of an output whose calls open with `open` anywhere in it (`<tool_call>` blocks):
/// free text ends the output; each `call` (the format's rule, which goes on after `open`) may be
/// followed by more text and calls, or by text only when `at_most_one`.
pub fn calls_after(open: &str, at_most_one: bool) -> String {
    let more = if at_most_one {
        "TEXT"
    } else {
        "TEXT | prefix call more"
    };
    format!(
        "start: TEXT | prefix call more\nmore: {more}\n{}{}",
        free_text(&[holding(open)]),
        prefix(open, &[])
    )
}

/// `calls`: a list of `call`s (the format's rule), `[` and `]` around them and `,` between, with
/// whitespace about them, as Mistral's JSON array and a pythonic call list write them; one call
/// only when `at_most_one`. llguidance's lexer is greedy (a lexeme that can go on does), so free
/// text that may still turn into a list would go on past a `[` written as a lexeme of its own:
/// the list opens with one lexeme, OPEN, which the first call's opening ends, and the format's
/// free text (and any text before a marker) must end there too.
pub fn call_list(at_most_one: bool) -> String {
    let more = if at_most_one { "" } else { " (SEP call)*" };
    let space = "[ \\t\\r\\n]*";
    format!(
        "calls: OPEN call{more} CLOSE\n\
         OPEN: /{space}\\[{space}/\n\
         SEP: /{space},{space}/\n\
         CLOSE: /{space}\\]{space}/\n"
    )
}

/// The rule `name`: `items` (Lark expressions, each with whether it is required) in their order,
/// `separator` (a Lark expression, or empty) between those written; a required item is always
/// there, an optional one may be left out. `name_h{i}` is the rest from item `i` when nothing
/// has been written yet, `name_t{i}` when something has (so item `i` needs its separator): rules
/// linear in the items, where listing the subsets would not be. `items` is not empty.
pub fn sequence(name: &str, items: &[(String, bool)], separator: &str) -> String {
    let separator = if separator.is_empty() {
        String::new()
    } else {
        format!("{separator} ")
    };
    let head = |at: usize| match at {
        0 => name.to_owned(),
        at => format!("{name}_h{at}"),
    };
    let mut rules = String::new();
    // Whether nothing may have been written before item `at` (only optional items came before).
    let mut from_start = true;
    for (at, (item, required)) in items.iter().enumerate() {
        let last = at + 1 == items.len();
        let tail = if last {
            String::new()
        } else {
            format!(" {name}_t{}", at + 1)
        };
        let from_head = match (required, last) {
            (true, _) => format!("{item}{tail}"),
            (false, false) => format!("{item}{tail} | {}", head(at + 1)),
            (false, true) => format!("({item})?"),
        };
        if from_start {
            rules.push_str(&format!("{}: {from_head}\n", head(at)));
        }
        from_start &= !required;
        if at > 0 {
            let from_tail = if *required {
                format!("{separator}{item}{tail}")
            } else {
                format!("({separator}{item})?{tail}")
            };
            rules.push_str(&format!("{name}_t{at}: {from_tail}\n"));
        }
    }
    rules
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_are_literal_in_regexes_and_literals() {
        assert_eq!(holding("[TOOL_CALLS]"), "(?s:.*\\[TOOL_CALLS\\].*)");
        assert_eq!(regex_escape("</parameter>"), "<\\/parameter>");
        assert_eq!(literal("a\"\n"), "\"a\\\"\\n\"");
    }

    #[test]
    fn a_sequence_keeps_its_order_and_leaves_out_only_optional_items() {
        let items = [("A".into(), false), ("B".into(), true), ("C".into(), false)];
        assert_eq!(
            sequence("s", &items, "SEP"),
            "s: A s_t1 | s_h1\n\
             s_h1: B s_t2\n\
             s_t1: SEP B s_t2\n\
             s_t2: (SEP C)?\n"
        );
        assert_eq!(sequence("s", &[("A".into(), true)], ""), "s: A\n");
    }
}
