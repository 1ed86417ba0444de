//! Reasoning models' thinking split from their answer (`--reasoning-parser`): Qwen3 and the
//! DeepSeek-R1 family write their thinking between `<think>` and `</think>`, and chat returns it as
//! `reasoning_content` beside `content`, whole and streamed, as vLLM does.
//!
//! Where thinking starts: inside a think block that the prompt opened (templates that end their
//! generation prompt with `<think>`), or at a `<think>` that opens the output; with `deepseek_r1`,
//! always (R1 models think first, and some templates write the opening tag themselves). It ends at
//! `</think>`; an output that never closes it was all thinking. Text that may still turn into a tag
//! is held back until it is known.
//!
//! The thinking's tokens (`reasoning_tokens` in usage) are counted as OpenAI and vLLM count them:
//! the output's tokens up to and including the end of thinking, all of them when it never ends.

use crate::text::partial_marker::partial_marker_len;

pub const THINK_START: &str = "<think>";
pub const THINK_END: &str = "</think>";

/// The formats `--reasoning-parser` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReasoningParser {
    /// Qwen3: thinks when its template opens a think block, or when it writes `<think>`.
    Qwen3,
    /// DeepSeek-R1 and its distills: every answer starts with thinking.
    #[value(name = "deepseek_r1")]
    DeepseekR1,
}

impl ReasoningParser {
    /// Whether an output after `prompt` starts inside thinking (before any `<think>` it writes).
    pub fn starts_thinking(self, prompt: &str) -> bool {
        self == ReasoningParser::DeepseekR1 || prompt_opens_thinking(prompt)
    }
}

/// Whether the rendered prompt ends inside a think block: its last `<think>` is not closed.
fn prompt_opens_thinking(prompt: &str) -> bool {
    match (prompt.rfind(THINK_START), prompt.rfind(THINK_END)) {
        (Some(start), Some(end)) => start > end,
        (Some(_), None) => true,
        (None, _) => false,
    }
}

/// What one piece of output added to each part.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReasoningPiece {
    pub reasoning: String,
    pub content: String,
    /// Whether the piece was read inside the thinking (its tags too), even where it added nothing.
    pub thought: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// Nothing read yet but perhaps whitespace: a `<think>` may still open the output.
    Opening {
        thinking: bool,
    },
    Thinking,
    /// Right after a tag: newlines before the thinking (after `<think>`) or the answer (after
    /// `</think>`) are dropped.
    AfterTag {
        then_answer: bool,
    },
    Answer,
}

/// One choice's output split as it grows.
#[derive(Debug, Clone)]
pub struct ReasoningStream {
    part: Part,
    /// Text not yet given out: a tag's possible beginning, or the output's opening whitespace.
    held: String,
}

impl ReasoningStream {
    pub fn new(starts_thinking: bool) -> Self {
        ReasoningStream {
            part: Part::Opening {
                thinking: starts_thinking,
            },
            held: String::new(),
        }
    }

    /// Takes the next piece of output (`finished` on the last) and answers what it added.
    pub fn push(&mut self, text: &str, finished: bool) -> ReasoningPiece {
        self.held.push_str(text);
        let mut piece = ReasoningPiece::default();
        loop {
            let held = std::mem::take(&mut self.held);
            match self.part {
                Part::Opening { thinking } => {
                    let start = held.trim_start();
                    if let Some(rest) = start.strip_prefix(THINK_START) {
                        piece.thought = true;
                        self.part = Part::AfterTag { then_answer: false };
                        self.held = rest.to_owned();
                    } else if THINK_START.starts_with(start) && !finished {
                        // Whitespace, or the tag's beginning: wait for more.
                        self.held = held;
                        return piece;
                    } else {
                        self.part = if thinking {
                            Part::Thinking
                        } else {
                            Part::Answer
                        };
                        self.held = held;
                    }
                }
                Part::Thinking => {
                    piece.thought = true;
                    match held.find(THINK_END) {
                        Some(at) => {
                            piece.reasoning.push_str(&held[..at]);
                            self.part = Part::AfterTag { then_answer: true };
                            self.held = held[at + THINK_END.len()..].to_owned();
                        }
                        None => {
                            let keep = if finished {
                                0
                            } else {
                                partial_marker_len(&held, THINK_END)
                            };
                            piece.reasoning.push_str(&held[..held.len() - keep]);
                            self.held = held[held.len() - keep..].to_owned();
                            return piece;
                        }
                    }
                }
                Part::AfterTag { then_answer } => {
                    piece.thought |= !then_answer;
                    let rest = held.trim_start_matches(['\n', '\r']);
                    if rest.is_empty() && !finished {
                        return piece;
                    }
                    self.part = if then_answer {
                        Part::Answer
                    } else {
                        Part::Thinking
                    };
                    self.held = rest.to_owned();
                }
                Part::Answer => {
                    piece.content.push_str(&held);
                    return piece;
                }
            }
        }
    }
}

/// A choice's reasoning tokens, counted as its output grows.
#[derive(Debug, Clone)]
pub struct ReasoningTokens {
    stream: ReasoningStream,
    count: u32,
}

impl ReasoningTokens {
    pub fn new(starts_thinking: bool) -> Self {
        ReasoningTokens {
            stream: ReasoningStream::new(starts_thinking),
            count: 0,
        }
    }

    /// Takes the next piece of output (`finished` on the last), `tokens` being the output's tokens
    /// so far, and answers the reasoning tokens so far: all the tokens up to a piece read inside
    /// the thinking.
    pub fn push(&mut self, text: &str, tokens: u32, finished: bool) -> u32 {
        if self.stream.push(text, finished).thought {
            self.count = tokens;
        }
        self.count
    }
}

/// A whole output split at once: the thinking (None when there was none) and the answer.
pub fn split_whole(starts_thinking: bool, text: &str) -> (Option<String>, String) {
    let piece = ReasoningStream::new(starts_thinking).push(text, true);
    let reasoning = (!piece.reasoning.is_empty()).then_some(piece.reasoning);
    (reasoning, piece.content)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pushes `text` in pieces of `size` bytes (on char boundaries) and joins what comes out.
    fn streamed(starts_thinking: bool, text: &str, size: usize) -> (String, String) {
        let mut stream = ReasoningStream::new(starts_thinking);
        let (mut reasoning, mut content) = (String::new(), String::new());
        let chars: Vec<char> = text.chars().collect();
        let pieces: Vec<String> = chars.chunks(size).map(|c| c.iter().collect()).collect();
        for (at, piece) in pieces.iter().enumerate() {
            let out = stream.push(piece, at + 1 == pieces.len());
            reasoning += &out.reasoning;
            content += &out.content;
        }
        if pieces.is_empty() {
            let out = stream.push("", true);
            reasoning += &out.reasoning;
            content += &out.content;
        }
        (reasoning, content)
    }

    #[test]
    fn thinking_and_answer_split_the_same_whole_and_in_any_pieces() {
        let cases = [
            // (starts thinking, output, reasoning, content)
            (
                false,
                "<think>\nLet me see.\n</think>\n\nParis.",
                "Let me see.\n",
                "Paris.",
            ),
            (true, "Let me see.</think>Paris.", "Let me see.", "Paris."),
            (false, "Paris, of course.", "", "Paris, of course."),
            (false, "  <think>x</think>y", "x", "y"),
            // Never closed: all of it was thinking.
            (true, "still thinking <", "still thinking <", ""),
            (false, "<think>cut off", "cut off", ""),
            // A tag's beginning that turns out to be text.
            (false, "<thin air", "", "<thin air"),
            (true, "a </thunk> b</think>c", "a </thunk> b", "c"),
            (false, "", "", ""),
            (false, "<think></think>\n\nHi </think>", "", "Hi </think>"),
            (true, "<think>é</think>ü", "é", "ü"),
        ];
        for (starts, output, reasoning, content) in cases {
            let (whole_reasoning, whole_content) = split_whole(starts, output);
            assert_eq!(
                (
                    whole_reasoning.unwrap_or_default().as_str(),
                    whole_content.as_str()
                ),
                (reasoning, content),
                "{output:?}"
            );
            for size in [1, 2, 3, 7, 100] {
                assert_eq!(
                    streamed(starts, output, size),
                    (reasoning.to_owned(), content.to_owned()),
                    "{output:?} in pieces of {size}"
                );
            }
        }
    }

    #[test]
    fn reasoning_tokens_run_to_the_piece_that_ends_the_thinking() {
        // (starts thinking, the output one token a piece, its reasoning tokens)
        let cases: [(bool, &[&str], u32); 6] = [
            (
                false,
                &[
                    "<think>", "\n", "Hmm", ".", "</think>", "\n\n", "Paris", ".",
                ],
                5,
            ),
            (true, &["Hmm", "</think>", "Paris"], 2),
            // Never closed: all of it.
            (true, &["Hmm", " still"], 2),
            (false, &["Paris", "."], 0),
            (false, &["<", "think", ">", "x", "</", "think", ">", "y"], 7),
            // A piece of several tokens that ends the thinking counts whole.
            (true, &["Hmm", "</think>\n\nParis"], 2),
        ];
        for (starts, pieces, expected) in cases {
            let mut counter = ReasoningTokens::new(starts);
            let mut count = 0;
            for (at, piece) in pieces.iter().enumerate() {
                count = counter.push(piece, at as u32 + 1, at + 1 == pieces.len());
            }
            assert_eq!(count, expected, "{pieces:?}");
        }
    }

    #[test]
    fn a_prompt_opens_thinking_when_its_last_think_is_unclosed() {
        let qwen = ReasoningParser::Qwen3;
        assert!(qwen.starts_thinking("<|im_start|>assistant\n<think>\n"));
        // Qwen3 with enable_thinking false: an empty, closed block.
        assert!(!qwen.starts_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(!qwen.starts_thinking("<|im_start|>assistant\n"));
        assert!(ReasoningParser::DeepseekR1.starts_thinking("<｜Assistant｜>"));
        use clap::ValueEnum;
        assert_eq!(
            ReasoningParser::from_str("deepseek_r1", false),
            Ok(ReasoningParser::DeepseekR1)
        );
        assert!(ReasoningParser::from_str("granite", false).is_err());
    }
}
