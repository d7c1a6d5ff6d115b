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

use crate::deadline;
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
    /// Tool calls, one of these tools per call: (name, JSON schema of its arguments). Each
    /// schema is its own document (its `$defs` resolve in it). `one`: exactly one call, else one
    /// or more (OpenAI's named and `"required"` `tool_choice`). `xml`: in Qwen3-Coder's form
    /// (`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n…</function>\n
    /// </tool_call>`, see [`xml_call`]), else in the Hermes form Qwen3 writes
    /// (`<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>`).
    ToolCalls {
        tools: Vec<(String, Value)>,
        one: bool,
        xml: bool,
    },
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
    Think::after_chat_prompt(prompt) == Think::Open
}

/// The reasoning text up to and including `</think>` (lazy: the first one ends it), and the
/// whitespace Qwen3 puts before its answer (bounded, as the JSON gaps are: a model must not
/// pad its answer with whitespace up to its token limit).
const THINK_RULES: &str =
    "think_text[lazy]: /(.|\\n)*<\\/think>/\nTHINK_GAP: /[ \\t\\r\\n]{1,8}/\n";

/// The most bytes of Lark text (JSON schemas included) a grammar may have. llguidance compiles
/// nested rules and `$ref` chains recursively: the bound keeps the deepest possible grammar
/// within [`COMPILE_STACK`].
pub const MAX_GRAMMAR_BYTES: usize = 256 * 1024;

/// The stack of the thread that compiles a grammar (a chain of 600 `$ref`s overflowed tokio's
/// 2 MiB; [`MAX_GRAMMAR_BYTES`] of the deepest chain needs about a quarter of this). Reserved
/// address space; only what the compile touches is used.
const COMPILE_STACK: usize = 256 * 1024 * 1024;

/// The longest message a grammar error keeps: llguidance's can hold the whole grammar and the
/// parser's state.
const MAX_ERROR_CHARS: usize = 400;

/// `e` in at most [`MAX_ERROR_CHARS`] characters (llguidance's "no extension" state dump in
/// words).
fn short(e: impl fmt::Display) -> String {
    let s = e.to_string();
    if s.starts_with("NoExtensionBias") {
        return "it admits no answer from here".into();
    }
    match s.char_indices().nth(MAX_ERROR_CHARS) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

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
    /// The reasoning block this grammar allows before the answer to `chat_prompt` (a rendered
    /// chat prompt; `None` for a raw one): none for Lark grammars, which describe the whole
    /// answer, else as [`Think::after_chat_prompt`] says.
    pub fn think_after(&self, chat_prompt: Option<&str>) -> Think {
        match chat_prompt {
            Some(p) if !matches!(self, GrammarSpec::Lark(_)) => Think::after_chat_prompt(p),
            _ => Think::No,
        }
    }

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
            GrammarSpec::ToolCalls { tools, one, xml } => {
                if tools.is_empty() {
                    bail!("tool calls need at least one tool");
                }
                // One rule per tool: the call's envelope as the model's template shows it, the
                // arguments under the tool's own schema (a document of its own).
                let mut rules = String::new();
                let mut alts = Vec::new();
                for (i, (name, params)) in tools.iter().enumerate() {
                    if !params.is_object() && !params.is_boolean() {
                        bail!("the parameters of tool {name:?} are not a JSON schema");
                    }
                    alts.push(format!("call_{i}"));
                    if *xml {
                        rules.push_str(&xml_call(i, name, params));
                        continue;
                    }
                    let head = format!(
                        "{{\"name\": {}, \"arguments\": ",
                        Value::from(name.as_str())
                    );
                    // A Lark string literal is a JSON string.
                    let head = Value::from(head).to_string();
                    rules.push_str(&format!(
                        "call_{i}: {head} %json {} \"}}\"\n",
                        bounded(params)
                    ));
                }
                if *xml {
                    rules.push_str(XML_RULES);
                }
                let more = if *one { "" } else { " (TOOL_GAP tool_call)*" };
                return Ok(format!(
                    "{}tool_call{more}\ntool_call: \"<tool_call>\\n\" ({}) \"\\n</tool_call>\"\n{rules}TOOL_GAP: /[ \\t\\r\\n]{{1,4}}/\n{}",
                    Self::start(think),
                    alts.join(" | "),
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
    /// `think` allows, and takes its first step (so a grammar that admits no answer, or whose
    /// first step does not end within [`crate::deadline::FIRST_STEP_LIMIT`], is an error here;
    /// behind a think block, the answer's own first step is checked too).
    /// Errors name what is wrong with the grammar, in a few hundred characters.
    pub fn compile(&self, compiler: &GrammarCompiler, think: Think) -> Result<Constraint> {
        if think != Think::No {
            // The think block hides an answer grammar that admits nothing until the model has
            // reasoned to its token limit: check the answer alone first.
            self.compile(compiler, Think::No)?;
        }
        let lark = self.lark(think)?;
        if lark.len() > MAX_GRAMMAR_BYTES {
            bail!(
                "the grammar is {} bytes; at most {MAX_GRAMMAR_BYTES} are compiled",
                lark.len()
            );
        }
        // On a thread of its own: llguidance compiles recursively (see COMPILE_STACK).
        let matcher = std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("grammar-compile".into())
                .stack_size(COMPILE_STACK)
                .spawn_scoped(scope, || first_step(compiler, lark))
                .map_err(|e| anyhow!("cannot start the grammar compiler's thread: {e}"))?
                .join()
                .map_err(|_| anyhow!("invalid grammar: the compiler failed"))?
        })?;
        Ok(Constraint {
            matcher,
            eos: Arc::clone(&compiler.eos),
            trie_eos: compiler.trie_eos,
        })
    }
}

/// Terminals of Qwen3-Coder's calls: a text value, up to and including the first
/// `\n</parameter>\n` (lazy, as the think block's end), and a parameter name of a tool that
/// declares none.
const XML_RULES: &str =
    "xml_text[lazy]: /(.|\\n)*\\n<\\/parameter>\\n/\nXML_NAME: /[^<>\\n]{1,64}/\n";

/// Rule `call_{i}` (and its parameters' rules) for tool `name` in Qwen3-Coder's form, as its
/// template shows calls: `<function=NAME>\n`, then per parameter `<parameter=KEY>\nVALUE\n
/// </parameter>\n`, then `</function>`. The declared properties come in their declared order,
/// the required ones always, the others optionally (the order the template lists them in;
/// the server's parser takes any). A value whose schema types it as a string (or does not type
/// it) is text: one of its `enum` strings where it lists them, else free up to
/// `\n</parameter>\n`; any other is JSON under the property's schema,
/// with the tool's `$defs` beside it (how the server's parser reads such values). A tool
/// without declared properties takes any named parameters with text values.
fn xml_call(i: usize, name: &str, params: &Value) -> String {
    let lit = |t: String| Value::from(t).to_string();
    let required: Vec<&str> = params
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut rules = String::new();
    let mut seq = Vec::new();
    match params.get("properties").and_then(Value::as_object) {
        Some(props) if !props.is_empty() => {
            for (j, (key, schema)) in props.iter().enumerate() {
                let end = lit("\n</parameter>\n".into());
                let choices: Option<Vec<String>> =
                    schema.get("enum").and_then(Value::as_array).and_then(|e| {
                        e.iter()
                            .map(|v| v.as_str().map(|t| lit(t.into())))
                            .collect()
                    });
                let value = if let (true, Some(c)) = (is_text_param(schema), &choices) {
                    // Text from a list: one of its strings.
                    format!("({}) {end}", c.join(" | "))
                } else if is_text_param(schema) {
                    "xml_text".to_owned()
                } else {
                    let mut doc = schema.clone();
                    if let (Some(o), Some(p)) = (doc.as_object_mut(), params.as_object()) {
                        for defs in ["$defs", "definitions"] {
                            if let Some(d) = p.get(defs) {
                                o.entry(defs).or_insert_with(|| d.clone());
                            }
                        }
                    }
                    format!("%json {} {end}", bounded(&doc))
                };
                let head = lit(format!("<parameter={key}>\n"));
                rules.push_str(&format!("param_{i}_{j}: {head} {value}\n"));
                let opt = if required.contains(&key.as_str()) {
                    ""
                } else {
                    "?"
                };
                seq.push(format!("param_{i}_{j}{opt}"));
            }
        }
        _ => {
            rules.push_str(&format!(
                "param_{i}: \"<parameter=\" XML_NAME \">\\n\" xml_text\n"
            ));
            seq.push(format!("param_{i}*"));
        }
    }
    rules.push_str(&format!(
        "call_{i}: {} {} \"</function>\"\n",
        lit(format!("<function={name}>\n")),
        seq.join(" ")
    ));
    rules
}

/// Whether a Qwen3-Coder parameter of this schema is written as plain text: typed a string
/// (a type list's first non-null entry), or not typed at all.
fn is_text_param(schema: &Value) -> bool {
    let ty = match schema.get("type") {
        Some(Value::String(t)) => Some(t.as_str()),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).find(|t| *t != "null"),
        _ => None,
    };
    ty.is_none_or(|t| t == "string")
}

/// The matcher of `lark` after its first mask (computed here to check it, and cached).
fn first_step(compiler: &GrammarCompiler, lark: String) -> Result<Matcher> {
    let parser = compiler
        .factory
        .create_parser(TopLevelGrammar::from_lark(lark))
        .map_err(|e| anyhow!("invalid grammar: {}", short(e)))?;
    let mut matcher = Matcher::new(Ok(parser)).into_cancellable();
    if let Some(e) = matcher.get_error() {
        bail!("invalid grammar: {}", short(e));
    }
    let handle = matcher.cancellation_handle();
    let first = deadline::guard(handle, deadline::FIRST_STEP_LIMIT, || {
        matcher.compute_mask()
    });
    match first {
        Err(_) if matcher.is_cancelled() => bail!(
            "invalid grammar: its first step did not end within {} s",
            deadline::FIRST_STEP_LIMIT.as_secs()
        ),
        Err(e) => bail!("invalid grammar: {}", short(e)),
        Ok(m) if m.is_zero() && !matcher.is_accepting().unwrap_or(false) => {
            bail!("invalid grammar: it admits no answer")
        }
        Ok(_) => Ok(matcher),
    }
}

/// The tokenizer as llguidance sees it: a trie of every id's bytes and an encoder.
struct TrieEnv {
    trie: TokTrie,
    /// The tokenizer with special tokens encoded as their text: bytes a grammar forces are
    /// text, and `<|im_end|>` in them must not become the end token.
    plain: tokenizers::Tokenizer,
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // The tokenizer's own ids where the bytes are text (the ids a prompt would get); the
        // trie's longest matches for bytes that split a character.
        let ids = std::str::from_utf8(s)
            .ok()
            .and_then(|t| self.plain.encode(t, false).ok())
            .map(|e| e.get_ids().to_vec());
        match ids {
            // Only ids the trie holds as text (never a special one).
            Some(ids) if ids.iter().all(|&i| !self.trie.is_special_token(i)) => ids,
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
        let mut plain = tok.inner().clone();
        plain.set_encode_special_tokens(true);
        let env: TokEnv = Arc::new(TrieEnv { trie, plain });
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        // Errors without the parser's state and the grammar (llguidance's verbose default):
        // they go to clients, and a dump of tokens and rules is long and says nothing there.
        factory.limits_mut().verbose_errors = false;
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
        let handle = self.matcher.cancellation_handle();
        let matcher = &mut self.matcher;
        let allowed = deadline::guard(handle, deadline::STEP_LIMIT, || {
            matcher.compute_mask_or_eos()
        });
        let allowed = allowed.map_err(|e| {
            if self.matcher.is_cancelled() {
                anyhow!(
                    "grammar: a step did not end within {} ms",
                    deadline::STEP_LIMIT.as_millis()
                )
            } else {
                anyhow!("grammar: {}", short(e))
            }
        })?;
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
            .map_err(|e| anyhow!("grammar: token {id} rejected: {}", short(e)))
    }
}
