//! Stop strings over a stream of text deltas.
//!
//! A stop string may arrive split across deltas, so the matcher holds back the
//! longest tail of the text that could still grow into a stop string, and
//! releases it as soon as it cannot. The first stop string to be completed in
//! the stream wins (on a tie, the one starting earlier); this makes the result
//! independent of how the text was cut into deltas.

/// What the caller does with one delta's worth of text.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum StopStep {
    /// Send `text` (possibly empty) and keep streaming.
    Continue { text: String },
    /// Send `text`, the last text of the response, and abort the engine request
    /// now: everything generated after the stop string is discarded.
    Stopped {
        text: String,
        /// Index of the matched stop string in the list given to [`StopMatcher::new`].
        stop_index: usize,
    },
}

#[derive(Debug, Clone)]
pub struct StopMatcher {
    /// Each stop string with its index in the caller's list; empty ones are dropped.
    stops: Vec<(usize, String)>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    pub fn new<I, S>(stops: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let stops = stops
            .into_iter()
            .map(Into::into)
            .enumerate()
            .filter(|(_, stop)| !stop.is_empty())
            .collect();
        Self {
            stops,
            held: String::new(),
            stopped: false,
        }
    }

    /// The stop string at `stop_index` in the list given to [`StopMatcher::new`].
    pub fn stop_string(&self, stop_index: usize) -> &str {
        self.stops
            .iter()
            .find(|(index, _)| *index == stop_index)
            .map(|(_, stop)| stop.as_str())
            .expect("a stop index the matcher reported")
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Feeds the next delta. After a `Stopped` step, later deltas yield nothing.
    pub fn push(&mut self, delta: &str) -> StopStep {
        if self.stopped {
            return StopStep::Continue {
                text: String::new(),
            };
        }
        let mut pending = std::mem::take(&mut self.held);
        pending.push_str(delta);

        if let Some((start, stop_index)) = self.first_completed_stop(&pending) {
            self.stopped = true;
            pending.truncate(start);
            return StopStep::Stopped {
                text: pending,
                stop_index,
            };
        }
        let held_from = self.start_of_possible_stop(&pending);
        self.held = pending.split_off(held_from);
        StopStep::Continue { text: pending }
    }

    /// Releases the held tail when the stream ends without a stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// The (start, stop index) of the stop string whose first occurrence ends earliest.
    fn first_completed_stop(&self, text: &str) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .filter_map(|(index, stop)| {
                text.find(stop.as_str())
                    .map(|start| (start + stop.len(), start, *index))
            })
            .min()
            .map(|(_, start, index)| (start, index))
    }

    /// Where the longest suffix of `text` that is a proper prefix of a stop string
    /// begins (`text.len()` when there is none). No stop string is in `text`.
    fn start_of_possible_stop(&self, text: &str) -> usize {
        let longest_stop = self.stops.iter().map(|(_, s)| s.len()).max().unwrap_or(0);
        let earliest = text.len().saturating_sub(longest_stop.saturating_sub(1));
        text.char_indices()
            .map(|(start, _)| start)
            .filter(|start| *start >= earliest)
            .find(|start| {
                let suffix = &text[*start..];
                self.stops.iter().any(|(_, stop)| stop.starts_with(suffix))
            })
            .unwrap_or(text.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the whole text yields without streaming: the text before the stop
    /// string that ends first, and that stop string's index.
    fn expected_output(text: &str, stops: &[&str]) -> (String, Option<usize>) {
        let matcher = StopMatcher::new(stops.iter().copied());
        match matcher.first_completed_stop(text) {
            Some((start, index)) => (text[..start].to_owned(), Some(index)),
            None => (text.to_owned(), None),
        }
    }

    /// Streams `deltas` and returns the emitted text and the stop index, checking
    /// that nothing is emitted after a stop.
    fn streamed_output(deltas: &[&str], stops: &[&str]) -> (String, Option<usize>) {
        let mut matcher = StopMatcher::new(stops.iter().copied());
        let mut emitted = String::new();
        let mut matched = None;
        for delta in deltas {
            match matcher.push(delta) {
                StopStep::Continue { text } => {
                    assert!(matched.is_none() || text.is_empty(), "text after a stop");
                    emitted.push_str(&text);
                }
                StopStep::Stopped { text, stop_index } => {
                    assert!(matched.is_none(), "stopped twice");
                    emitted.push_str(&text);
                    matched = Some(stop_index);
                }
            }
        }
        if matched.is_none() {
            emitted.push_str(&matcher.finish());
        } else {
            assert_eq!(matcher.finish(), "");
        }
        (emitted, matched)
    }

    fn char_boundaries(text: &str) -> Vec<usize> {
        text.char_indices()
            .map(|(i, _)| i)
            .chain([text.len()])
            .collect()
    }

    /// Checks the text cut once at every character boundary and cut at every character.
    fn assert_every_split_matches(text: &str, stops: &[&str]) {
        let expected = expected_output(text, stops);
        for split in char_boundaries(text) {
            let (head, tail) = text.split_at(split);
            assert_eq!(
                streamed_output(&[head, tail], stops),
                expected,
                "{text:?} split at {split}"
            );
        }
        let per_char: Vec<String> = text.chars().map(String::from).collect();
        let per_char: Vec<&str> = per_char.iter().map(String::as_str).collect();
        assert_eq!(
            streamed_output(&per_char, stops),
            expected,
            "{text:?} per char"
        );
    }

    #[test]
    fn stop_string_split_across_deltas_is_caught_at_every_split() {
        let text = "The answer is 42.\n\nUser: next question";
        assert_eq!(
            expected_output(text, &["\n\nUser:"]),
            ("The answer is 42.".to_owned(), Some(0))
        );
        assert_every_split_matches(text, &["\n\nUser:"]);
    }

    #[test]
    fn overlapping_candidates_are_not_lost() {
        // A naive matcher that restarts after a failed partial match misses these.
        assert_every_split_matches("aaab", &["aab"]);
        assert_every_split_matches("abababc", &["ababc"]);
        assert_every_split_matches("xabcabd", &["abcabd", "cab"]);
        assert_eq!(expected_output("aaab", &["aab"]), ("a".to_owned(), Some(0)));
    }

    #[test]
    fn the_stop_string_completed_first_wins() {
        let stops = ["abcd", "bc", "zz"];
        assert_eq!(expected_output("xabcd", &stops), ("xa".to_owned(), Some(1)));
        assert_every_split_matches("xabcd", &stops);
        // Completed at the same point, the longer (earlier-starting) one wins.
        let stops = ["cd", "bcd"];
        assert_eq!(expected_output("abcde", &stops), ("a".to_owned(), Some(1)));
        assert_every_split_matches("abcde", &stops);
    }

    #[test]
    fn multiple_stop_strings_report_which_matched() {
        let stops = ["END", "</s>", "###"];
        for (text, expected) in [
            ("one </s> two END", ("one ", Some(1))),
            ("one ### two </s>", ("one ", Some(2))),
            ("one END", ("one ", Some(0))),
            ("no stop <here> #", ("no stop <here> #", None)),
        ] {
            assert_eq!(
                expected_output(text, &stops),
                (expected.0.to_owned(), expected.1)
            );
            assert_every_split_matches(text, &stops);
        }
    }

    #[test]
    fn stop_at_the_very_start_emits_nothing() {
        let mut matcher = StopMatcher::new(["Hello"]);
        assert_eq!(
            matcher.push("Hello world"),
            StopStep::Stopped {
                text: String::new(),
                stop_index: 0
            }
        );
        assert!(matcher.is_stopped());
        assert_eq!(
            matcher.push(" more"),
            StopStep::Continue {
                text: String::new()
            }
        );
        assert_every_split_matches("Hello world", &["Hello"]);
    }

    #[test]
    fn text_that_stops_looking_like_a_stop_is_released_at_once() {
        let mut matcher = StopMatcher::new(["<|end|>"]);
        let step = matcher.push("a <|en");
        assert_eq!(step, StopStep::Continue { text: "a ".into() });
        let step = matcher.push("try");
        assert_eq!(
            step,
            StopStep::Continue {
                text: "<|entry".into()
            }
        );
        let step = matcher.push("<");
        assert_eq!(step, StopStep::Continue { text: "".into() });
        assert_eq!(matcher.finish(), "<");
        assert_eq!(matcher.finish(), "");
    }

    #[test]
    fn nothing_is_held_without_stop_strings() {
        let mut matcher = StopMatcher::new(Vec::<String>::new());
        assert_eq!(
            matcher.push("abc"),
            StopStep::Continue { text: "abc".into() }
        );
        let mut matcher = StopMatcher::new([""]);
        assert_eq!(
            matcher.push("abc"),
            StopStep::Continue { text: "abc".into() }
        );
    }

    #[test]
    fn unicode_stop_strings_match_across_deltas() {
        let stops = ["。", "👨‍👩‍👧", "終わり", "e\u{301}"];
        for text in [
            "你好世界。再见",
            "family 👨‍👩‍👧‍👦 here",
            "これで終わりです",
            "cafe\u{301} au lait",
            "café is precomposed, no stop",
        ] {
            assert_every_split_matches(text, &stops);
        }
        assert_eq!(
            expected_output("family 👨‍👩‍👧‍👦", &stops),
            ("family ".to_owned(), Some(1))
        );
    }

    /// A xorshift generator keeps the random cases reproducible without a dependency.
    struct XorShift(u64);

    impl XorShift {
        fn below(&mut self, bound: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % bound as u64) as usize
        }

        fn text(&mut self, len: usize) -> String {
            // A small alphabet makes partial and overlapping matches frequent.
            let alphabet = ['a', 'b', 'é', '🎉'];
            (0..len)
                .map(|_| alphabet[self.below(alphabet.len())])
                .collect()
        }
    }

    #[test]
    fn random_texts_and_cuts_match_the_unstreamed_result() {
        let mut random = XorShift(0x2545_f491_4f6c_dd1d);
        for _ in 0..500 {
            let stops: Vec<String> = (0..3)
                .map(|_| {
                    let len = 1 + random.below(4);
                    random.text(len)
                })
                .collect();
            let stops: Vec<&str> = stops.iter().map(String::as_str).collect();
            let text = random.text(12);
            assert_every_split_matches(&text, &stops);
        }
    }
}
