//! `best_of`: of each prompt's candidates, the n with the highest cumulative logprob.

use crate::api::fan_out::ChoiceResult;

/// `results` holds each prompt's `best_of` candidates in a row (as the fan-out numbers them);
/// the answer holds each prompt's `n` most likely, most likely first.
pub fn select(results: Vec<ChoiceResult>, best_of: u32, n: u32) -> Vec<ChoiceResult> {
    assert!(1 <= n && n <= best_of, "validation keeps n <= best_of");
    assert_eq!(
        results.len() % best_of as usize,
        0,
        "every prompt has best_of candidates"
    );
    if best_of == n {
        return results;
    }
    let mut selected = Vec::with_capacity(results.len() / best_of as usize * n as usize);
    let mut results = results.into_iter().peekable();
    while results.peek().is_some() {
        let mut candidates: Vec<ChoiceResult> = results.by_ref().take(best_of as usize).collect();
        candidates.sort_by(|a, b| b.cumulative_logprob.total_cmp(&a.cumulative_logprob));
        selected.extend(candidates.into_iter().take(n as usize));
    }
    selected
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(text: &str, cumulative_logprob: f64) -> ChoiceResult {
        ChoiceResult {
            text: text.into(),
            cumulative_logprob,
            ..ChoiceResult::default()
        }
    }

    #[test]
    fn each_prompt_keeps_its_n_most_likely_candidates() {
        let results = vec![
            candidate("a0", -3.0),
            candidate("a1", -1.0),
            candidate("a2", -2.0),
            candidate("b0", -0.5),
            candidate("b1", -9.0),
            candidate("b2", -0.25),
        ];
        let texts: Vec<String> = select(results, 3, 2).into_iter().map(|r| r.text).collect();
        assert_eq!(texts, ["a1", "a2", "b2", "b0"]);
    }

    #[test]
    fn best_of_equal_to_n_keeps_everything_in_order() {
        let results = vec![candidate("x", -5.0), candidate("y", -1.0)];
        assert_eq!(select(results.clone(), 2, 2), results);
    }
}
