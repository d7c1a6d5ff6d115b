//! Constrained decoding (structured outputs): a grammar decides which ids may come next, and the
//! logits of every other id are set to -inf before the sampler or the argmax picks.
//!
//! The grammars are compiled and run by llguidance (the engine llama.cpp and vLLM use for the
//! same job: JSON schemas, regular expressions and Lark grammars) over a token trie built once
//! per tokenizer from each id's bytes ([`Tokenizer::token_bytes`]); special tokens and ids the
//! tokenizer does not know are marked special there, so no text of a grammar matches them.
//!
//! A constrained request needs each step's logits on the host (they are masked before the
//! choice), so it steps like a logprobs request: no folded runs.
//!
//! Thinking models (Qwen3) open their answer with `<think>…</think>`. Compiled with
//! [`Think::May`] or [`Think::Open`], the grammar admits that block first and constrains what
//! follows it, as vLLM does when it parses reasoning: the constraint is on the answer, not on
//! the reasoning.
//!
//! End of generation: where the grammar may end, every EOS id of the model is allowed; where it
//! must end, only they are.

use std::fmt;
use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::tokenizer::Tokenizer;

/// What a constrained answer must be.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under this JSON schema (`response_format: {"type": "json_schema"}`).
    JsonSchema(Value),
    /// A Lark grammar in llguidance's dialect (its `start` rule is the answer).
    Lark(String),
    /// A regular expression the whole answer matches (Rust `regex` syntax).
    Regex(String),
    /// Exactly one of these texts (vLLM's `guided_choice`).
    Choice(Vec<String>),
    /// Tool calls in the Hermes form Qwen3 writes (`<tool_call>\n{json}\n</tool_call>`), each
    /// call's JSON valid under one of these schemas (an object of `name` and `arguments` per
    /// tool); `one`: exactly one call, else one or more (OpenAI's named and `"required"`
    /// `tool_choice`).
    ToolCalls { calls: Vec<Value>, one: bool },
}

/// Whether a thinking model's reasoning block may precede the constrained answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Think {
    /// The answer is constrained from its first token.
    No,
    /// A `<think>…</think>` block may come first, unconstrained (a chat answer of a thinking
    /// model: Qwen3 writes one unless the prompt already closed it).
    May,
    /// The prompt ended inside `<think>` (Qwen3 Thinking-2507 templates): the answer's
    /// reasoning runs, unconstrained, up to its `</think>`.
    Open,
}

impl Think {
    /// How the answer to a rendered chat `prompt` begins: [`Think::Open`] where the prompt ends
    /// with `<think>` (and whitespace), [`Think::No`] where it ends with `</think>` (thinking
    /// switched off: Qwen3's template writes the empty block itself), else [`Think::May`].
    pub fn after_chat_prompt(prompt: &str) -> Think {
        let end = prompt.trim_end_matches(|c: char| c.is_ascii_whitespace());
        if end.ends_with("<think>") {
            Think::Open
        } else if end.ends_with("</think>") {
            Think::No
        } else {
            Think::May
        }
    }
}

/// Whether a rendered chat prompt ends inside a thinking block (Qwen3 Thinking-2507 templates
/// end the generation prompt with `<think>\n`; Qwen3's own with thinking off closes it).
pub fn opens_thinking(prompt: &str) -> bool {
    prompt
        .trim_end_matches(|c: char| c.is_ascii_whitespace())
        .ends_with("<think>")
}

/// The reasoning text up to and including `</think>` (lazy: the first one ends it), and the
/// whitespace Qwen3 puts before its answer.
const THINK_RULES: &str = "think_text[lazy]: /(.|\\n)*<\\/think>/\nTHINK_GAP: /[ \\t\\r\\n]+/\n";

/// The whitespace a JSON answer may put between two of its tokens, as llama.cpp's JSON
/// grammars allow: one space, or a line break and up to 20 spaces or tabs of indent. Unbounded
/// whitespace lets a model pad an answer until its token limit (the synthetic models here did).
const JSON_GAP: &str = "(\\x20|\\x0D?\\x0A[\\x20\\x09]{0,20})";

/// `schema` with [`JSON_GAP`] as its whitespace, unless it sets its own (llguidance's
/// `x-guidance` options).
fn bounded(schema: &Value) -> Value {
    let mut s = match schema {
        Value::Bool(true) => serde_json::json!({}),
        s => s.clone(),
    };
    if let Some(o) = s.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_pattern": JSON_GAP}));
    }
    s
}

impl GrammarSpec {
    /// The Lark text of this grammar, behind the reasoning block `think` allows.
    fn lark(&self, think: Think) -> Result<String> {
        let answer = match self {
            GrammarSpec::JsonObject => {
                format!("%json {}", bounded(&serde_json::json!({"type": "object"})))
            }
            GrammarSpec::JsonSchema(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    bail!("a JSON schema is an object or a boolean");
                }
                format!("%json {}", bounded(schema))
            }
            GrammarSpec::Choice(texts) => {
                if texts.is_empty() {
                    bail!("a choice needs at least one text");
                }
                let alts: Vec<String> = texts.iter().map(|t| regex_syntax::escape(t)).collect();
                return GrammarSpec::Regex(format!("({})", alts.join("|"))).lark(think);
            }
            GrammarSpec::Regex(rx) => {
                // Through llguidance's own regex form, which owns the escaping rules.
                let top = TopLevelGrammar::from_regex(rx);
                let lark = top.grammars[0]
                    .lark_grammar
                    .clone()
                    .ok_or_else(|| anyhow!("regex did not become a grammar"))?;
                let body = lark
                    .strip_prefix("start: ")
                    .ok_or_else(|| anyhow!("unexpected regex grammar form"))?;
                body.to_string()
            }
            GrammarSpec::ToolCalls { calls, one } => {
                if calls.is_empty() {
                    bail!("tool calls need at least one tool");
                }
                let call = bounded(&if calls.len() == 1 {
                    calls[0].clone()
                } else {
                    serde_json::json!({ "anyOf": calls })
                });
                let more = if *one { "" } else { " (TOOL_GAP tool_call)*" };
                return Ok(format!(
                    "{}tool_call{more}\ntool_call: \"<tool_call>\\n\" %json {call} \"\\n</tool_call>\"\nTOOL_GAP: /[ \\t\\r\\n]+/\n{}",
                    Self::start(think),
                    Self::think_rules(think)
                ));
            }
            GrammarSpec::Lark(g) => {
                if think != Think::No {
                    bail!("a Lark grammar cannot be given a think block here; write one into the grammar");
                }
                return Ok(g.clone());
            }
        };
        Ok(format!(
            "{}answer\nanswer: {answer}\n{}",
            Self::start(think),
            Self::think_rules(think)
        ))
    }

    /// The start rule up to the answer's first symbol.
    fn start(think: Think) -> &'static str {
        match think {
            Think::No => "start: ",
            Think::May => "start: (\"<think>\" think_text THINK_GAP?)? ",
            Think::Open => "start: think_text THINK_GAP? ",
        }
    }

    fn think_rules(think: Think) -> &'static str {
        if think == Think::No {
            ""
        } else {
            THINK_RULES
        }
    }

    /// Compiles this grammar against `compiler`'s tokenizer, behind the reasoning block
    /// `think` allows. Errors name what is wrong with the grammar.
    pub fn compile(&self, compiler: &GrammarCompiler, think: Think) -> Result<Constraint> {
        let lark = self.lark(think)?;
        let parser = compiler
            .factory
            .create_parser(TopLevelGrammar::from_lark(lark))
            .map_err(|e| anyhow!("invalid grammar: {e}"))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            bail!("invalid grammar: {e}");
        }
        Ok(Constraint {
            matcher,
            eos: Arc::clone(&compiler.eos),
            trie_eos: compiler.trie_eos,
        })
    }
}

/// The tokenizer as llguidance sees it: a trie of every id's bytes and an encoder.
struct TrieEnv {
    trie: TokTrie,
    tok: Tokenizer,
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // The tokenizer's own ids where the bytes are text (the ids a prompt would get); the
        // trie's longest matches for bytes that split a character.
        match std::str::from_utf8(s).ok().map(|t| self.tok.encode(t)) {
            Some(Ok(ids)) => ids,
            _ => self.trie.greedy_tokenize(s),
        }
    }
}

/// Compiles grammars for one tokenizer (build once: the trie covers the whole vocabulary).
pub struct GrammarCompiler {
    factory: ParserFactory,
    /// Ids that end generation (the model's EOS set).
    eos: Arc<[u32]>,
    /// The EOS id the trie was told of (llguidance's masks mark it where the grammar may end).
    trie_eos: u32,
}

impl fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("eos", &self.eos)
            .finish()
    }
}

impl GrammarCompiler {
    /// A compiler for `tok`'s vocabulary with the model's EOS ids `eos` (non-empty).
    pub fn new(tok: &Tokenizer, eos: &[u32]) -> Result<Self> {
        let &first = eos
            .first()
            .ok_or_else(|| anyhow!("constrained decoding needs an end-of-sequence token"))?;
        let n = tok.vocab_size();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let bytes = tok.token_bytes(id);
                if tok.is_skipped_special(id) {
                    // Special (and unknown) ids: behind the marker byte, never text.
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(&bytes);
                    w
                } else {
                    bytes
                }
            })
            .collect();
        let trie_eos = if (first as usize) < n { first } else { 0 };
        let info = TokRxInfo::new(n as u32, trie_eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(TrieEnv {
            trie,
            tok: tok.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory,
            eos: eos.into(),
            trie_eos,
        })
    }
}

/// One generation's grammar state: which ids may come next. Clone it (cheaply) per request
/// from the compiled form.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    eos: Arc<[u32]>,
    trie_eos: u32,
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// Sets the logit of every id the grammar does not allow next to -inf. Where the grammar
    /// may end, the model's EOS ids stay; where it must end, only they do.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| anyhow!("grammar: {e}"))?;
        let may_end = allowed.is_allowed(self.trie_eos);
        // Every EOS id ends the answer where the grammar may end, not just the trie's own.
        let kept: Vec<(usize, f32)> = if may_end {
            self.eos
                .iter()
                .filter_map(|&e| logits.get(e as usize).map(|&l| (e as usize, l)))
                .collect()
        } else {
            Vec::new()
        };
        let n = allowed.len().min(logits.len());
        for (id, l) in logits.iter_mut().enumerate() {
            if id >= n || !allowed.is_allowed(id as TokenId) {
                *l = f32::NEG_INFINITY;
            }
        }
        for (id, l) in kept {
            logits[id] = l;
        }
        if logits.iter().all(|&l| l == f32::NEG_INFINITY) {
            bail!("no token the grammar allows here has a finite logit");
        }
        Ok(())
    }

    /// Moves the grammar past `id` (the id just chosen). An EOS id ends the grammar.
    pub fn commit(&mut self, id: u32) -> Result<()> {
        if self.eos.contains(&id) {
            return Ok(());
        }
        self.matcher
            .consume_token(id)
            .map_err(|e| anyhow!("grammar: token {id} rejected: {e}"))
    }
}
