//! End-of-generation detection: EOS ids and stop strings.
//!
//! The generation loop feeds each sampled id together with the text the [`StreamDecoder`]
//! released for it. [`StopChecker`] decides what text may be shown and whether to stop:
//! * an EOS id stops at once; its own text (e.g. `<|im_end|>`) is not emitted;
//! * a stop string stops at its first occurrence in the decoded text, even when it spans several
//!   tokens; the text before it is emitted, the stop string and anything after are not;
//! * text that could still turn into a stop string (a suffix equal to a prefix of one) is held
//!   back until the next token settles it, or released by [`StopChecker::finish`].
//!
//! Invariant: emitted text never ends in a proper prefix of a stop string, so a stop string can
//! only begin inside the held-back buffer and searching that buffer is enough.
//!
//! [`StreamDecoder`]: crate::tokenizer::StreamDecoder

/// Why generation stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// An end-of-generation token was sampled.
    Eos(u32),
    /// A stop string appeared in the output; the value is its index in the checker's list.
    StopString(usize),
}

/// The outcome of feeding one token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopStep {
    /// Text that is now safe to show (possibly empty).
    pub text: String,
    /// `Some` once generation must end; later calls emit nothing.
    pub stop: Option<StopReason>,
}

/// Stops on EOS ids and stop strings, holding back possible stop-string prefixes.
#[derive(Debug, Clone)]
pub struct StopChecker {
    eos_ids: Vec<u32>,
    stop_strings: Vec<String>,
    /// Decoded text not yet emitted.
    held: String,
    stopped: Option<StopReason>,
}

impl StopChecker {
    /// `eos_ids`: ids that end generation; `stop_strings`: texts that end it (empty strings are
    /// ignored).
    pub fn new(eos_ids: &[u32], stop_strings: &[String]) -> Self {
        Self {
            eos_ids: eos_ids.to_vec(),
            stop_strings: stop_strings.to_vec(),
            held: String::new(),
            stopped: None,
        }
    }

    /// The ids that end generation.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether a stop condition has been met.
    pub fn stopped(&self) -> Option<&StopReason> {
        self.stopped.as_ref()
    }

    /// Feeds one sampled id and the text decoded for it.
    pub fn push(&mut self, id: u32, text: &str) -> StopStep {
        if self.stopped.is_some() {
            return StopStep {
                text: String::new(),
                stop: self.stopped.clone(),
            };
        }
        if self.eos_ids.contains(&id) {
            // What was held back was not a stop string after all; release it.
            self.stopped = Some(StopReason::Eos(id));
            return StopStep {
                text: std::mem::take(&mut self.held),
                stop: self.stopped.clone(),
            };
        }
        self.held.push_str(text);

        // Earliest occurrence of any stop string (ties: the first listed).
        let first = self
            .stop_strings
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|pos| (pos, i)))
            .min();
        if let Some((pos, index)) = first {
            self.held.truncate(pos);
            self.stopped = Some(StopReason::StopString(index));
            return StopStep {
                text: std::mem::take(&mut self.held),
                stop: self.stopped.clone(),
            };
        }

        let keep_from = self.longest_prefix_suffix_start();
        let text = self.held[..keep_from].to_owned();
        self.held.drain(..keep_from);
        StopStep { text, stop: None }
    }

    /// Ends the stream without a stop: releases any held-back text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Byte offset where the longest suffix of `held` that is a proper prefix of some stop string
    /// begins (`held.len()` if there is none).
    fn longest_prefix_suffix_start(&self) -> usize {
        for (start, _) in self.held.char_indices() {
            let suffix = &self.held[start..];
            if self
                .stop_strings
                .iter()
                .any(|s| s.len() > suffix.len() && s.starts_with(suffix))
            {
                return start;
            }
        }
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checker(stops: &[&str]) -> StopChecker {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        StopChecker::new(&[151_645, 151_643], &stops)
    }

    /// Feeds pieces with a dummy non-EOS id; returns the emitted text and the stop reason.
    fn run(c: &mut StopChecker, pieces: &[&str]) -> (String, Option<StopReason>) {
        let mut out = String::new();
        for p in pieces {
            let step = c.push(7, p);
            out.push_str(&step.text);
            if step.stop.is_some() {
                return (out, step.stop);
            }
        }
        out.push_str(&c.finish());
        (out, None)
    }

    #[test]
    fn eos_stops_and_releases_held_text() {
        let mut c = checker(&["END"]);
        let s = c.push(7, "abc E");
        assert_eq!(
            s,
            StopStep {
                text: "abc ".into(),
                stop: None
            }
        );
        let s = c.push(151_643, "<|endoftext|>");
        assert_eq!(s.text, "E");
        assert_eq!(s.stop, Some(StopReason::Eos(151_643)));
        // After stopping nothing more is emitted.
        assert_eq!(c.push(7, "more").text, "");
        assert_eq!(c.stopped(), Some(&StopReason::Eos(151_643)));
    }

    #[test]
    fn stop_string_split_across_tokens_is_not_emitted() {
        let mut c = checker(&["</answer>"]);
        let (out, stop) = run(&mut c, &["The result", " is 4</", "ans", "wer> trailing"]);
        assert_eq!(out, "The result is 4");
        assert_eq!(stop, Some(StopReason::StopString(0)));
    }

    #[test]
    fn held_prefix_is_released_when_it_diverges() {
        let mut c = checker(&["STOP"]);
        assert_eq!(c.push(7, "x ST").text, "x ");
        assert_eq!(c.push(7, "O").text, "");
        assert_eq!(c.push(7, "RM").text, "STORM");
        let (out, stop) = run(&mut c, &[" ok S"]);
        assert_eq!(out, " ok S");
        assert_eq!(stop, None);
    }

    #[test]
    fn earliest_stop_string_wins() {
        let mut c = checker(&["bb", "a"]);
        let (out, stop) = run(&mut c, &["xxbba"]);
        assert_eq!(
            (out.as_str(), stop),
            ("xx", Some(StopReason::StopString(0)))
        );
        let mut c = checker(&["bb", "a"]);
        let (out, stop) = run(&mut c, &["xab"]);
        assert_eq!((out.as_str(), stop), ("x", Some(StopReason::StopString(1))));
    }

    #[test]
    fn multibyte_prefixes_are_held_on_char_boundaries() {
        let mut c = checker(&["世界!"]);
        assert_eq!(c.push(7, "你好世").text, "你好");
        assert_eq!(c.push(7, "界").text, "");
        let s = c.push(7, "!x");
        assert_eq!(s.text, "");
        assert_eq!(s.stop, Some(StopReason::StopString(0)));
    }

    #[test]
    fn empty_stop_strings_are_ignored() {
        let mut c = checker(&[""]);
        let (out, stop) = run(&mut c, &["abc", "def"]);
        assert_eq!((out.as_str(), stop), ("abcdef", None));
    }
}
