//! `--flag-schema`: a binary's flags as JSON (name, flag, help, kind, default, choices, the
//! environment variable it reads), so that `sluice serve` offers each flag that a child process
//! declares and forwards it, with no list of its own (python/sluice/serve/child_flags.py).

use std::any::TypeId;
use std::path::PathBuf;

use clap::{Arg, ArgAction, CommandFactory};
use serde_json::{json, Value};

/// The one argument that asks for the schema instead of running.
pub const FLAG_SCHEMA_ARG: &str = "--flag-schema";

/// Prints `A`'s flag schema and returns true when the command line is exactly `--flag-schema`.
pub fn print_if_asked<A: CommandFactory>() -> bool {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() != Some(FLAG_SCHEMA_ARG) || args.next().is_some() {
        return false;
    }
    println!("{}", flag_schema(&A::command()));
    true
}

/// Every long flag of `command` but --help and --version.
pub fn flag_schema(command: &clap::Command) -> Value {
    let flags: Vec<Value> = command
        .get_arguments()
        .filter(|arg| arg.get_long().is_some() && !is_builtin(arg))
        .map(describe)
        .collect();
    Value::Array(flags)
}

fn is_builtin(arg: &Arg) -> bool {
    matches!(arg.get_action(), ArgAction::Help | ArgAction::Version)
}

fn describe(arg: &Arg) -> Value {
    let defaults: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|value| value.to_string_lossy().into_owned())
        .collect();
    let choices: Vec<String> = arg
        .get_possible_values()
        .iter()
        .map(|value| value.get_name().to_owned())
        .collect();
    json!({
        "name": arg.get_id().as_str(),
        "flag": format!("--{}", arg.get_long().expect("long flags only")),
        "help": arg.get_help().map(|help| help.to_string()).unwrap_or_default(),
        "kind": kind(arg),
        "default": defaults.first(),
        "choices": if choices.is_empty() || kind(arg) == "flag" { Value::Null } else { json!(choices) },
        "env": arg.get_env().map(|name| name.to_string_lossy().into_owned()),
        "required": arg.is_required_set(),
        "repeated": matches!(arg.get_action(), ArgAction::Append),
    })
}

/// What a flag's value is: `flag` (present or absent), `int`, `float` or `text`.
fn kind(arg: &Arg) -> &'static str {
    if matches!(arg.get_action(), ArgAction::SetTrue) {
        return "flag";
    }
    let parsed = arg.get_value_parser().type_id();
    let integers = [
        TypeId::of::<usize>(),
        TypeId::of::<u64>(),
        TypeId::of::<u32>(),
        TypeId::of::<u16>(),
        TypeId::of::<u8>(),
    ];
    if integers.iter().any(|id| parsed == *id) {
        "int"
    } else if parsed == TypeId::of::<f64>() {
        "float"
    } else {
        // Strings, paths and value enums (whose choices say what they take).
        debug_assert!(
            parsed == TypeId::of::<String>()
                || parsed == TypeId::of::<PathBuf>()
                || !arg.get_possible_values().is_empty(),
            "flag --{:?} has a value type the schema cannot name",
            arg.get_long()
        );
        "text"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Example {
        /// How many.
        #[arg(long, default_value_t = 3)]
        count: usize,
        #[arg(long, default_value_t = 0.5)]
        ratio: f64,
        #[arg(long, env = "EXAMPLE_KEY")]
        key: Option<String>,
        #[arg(long)]
        quiet: bool,
        #[arg(long, value_parser = ["a", "b"], default_value = "a")]
        letter: String,
        #[arg(long = "item")]
        items: Vec<String>,
    }

    #[test]
    fn each_flag_is_described_with_its_kind_default_and_choices() {
        let schema = flag_schema(&Example::command());
        let by_name = |name: &str| {
            schema
                .as_array()
                .unwrap()
                .iter()
                .find(|flag| flag["name"] == name)
                .unwrap()
                .clone()
        };
        assert_eq!(
            by_name("count"),
            json!({"name": "count", "flag": "--count", "help": "How many", "kind": "int",
                   "default": "3", "choices": null, "env": null, "required": false, "repeated": false})
        );
        assert_eq!(by_name("ratio")["kind"], "float");
        assert_eq!(by_name("key")["env"], "EXAMPLE_KEY");
        assert_eq!(by_name("quiet")["kind"], "flag");
        assert_eq!(by_name("quiet")["choices"], Value::Null);
        assert_eq!(by_name("letter")["choices"], json!(["a", "b"]));
        assert_eq!(by_name("items")["flag"], "--item");
        assert_eq!(by_name("items")["repeated"], true);
        assert_eq!(schema.as_array().unwrap().len(), 6, "--help is left out");
    }
}
