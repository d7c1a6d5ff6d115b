//! Sampling, stop, output and grammar flags shared by `generate` and `chat`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use nibble_engine::grammar::{GrammarCompiler, GrammarSpec};
use nibble_engine::session::GenParams;
use nibble_engine::{Constraint, SamplingParams};

#[derive(clap::Args, Clone, Debug)]
pub struct SamplingArgs {
    /// 0 = greedy (the default).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Add BIAS to token ID's logit, llama.cpp's form `ID+BIAS` or `ID-BIAS` (repeatable; an
    /// id given twice gets the sum, as in llama.cpp): `--logit-bias 15043+1` favours token
    /// 15043, `--logit-bias 15043-inf` bans it. |BIAS| <= 1e6. Any bias samples on the host
    /// each step (no folded runs).
    #[arg(long = "logit-bias", value_name = "ID(+|-)BIAS", value_parser = parse_bias)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Seed of the sampler: the same seed gives the same bytes.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Print special tokens (`<|vision_start|>`, ...) and ids the tokenizer does not know (as
    /// `<|unk:ID|>`) in the output; by default they add no text, as in llama.cpp without
    /// `--special` and vLLM.
    #[arg(long)]
    pub special: bool,
    /// A string that ends generation (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Tokens decoded per folded run (greedy, or sampled on the GPU): 4, like `--fold`, from
    /// the fold sweep (docs/BENCHMARKS.md: longer runs size every step's attention grid for the
    /// run's last position).
    #[arg(long, default_value_t = 4)]
    pub run: usize,
    #[command(flatten)]
    pub grammar: GrammarArgs,
}

/// Structured output: a grammar the answer must follow (llama.cpp's `-j` / `-jf`), at most one.
/// A constrained answer samples on the host each step (its logits are masked first).
#[derive(clap::Args, Clone, Debug, Default)]
#[group(multiple = false)]
pub struct GrammarArgs {
    /// A JSON schema the answer is valid under, as JSON text (`'{"type": "object"}'`: any
    /// object). Whitespace between tokens is bounded as in llama.cpp's JSON grammars.
    #[arg(short = 'j', long, value_name = "SCHEMA")]
    pub json_schema: Option<String>,
    /// The same, read from a file.
    #[arg(long, value_name = "PATH")]
    pub json_schema_file: Option<PathBuf>,
    /// A grammar in Lark syntax (llguidance's dialect; llama.cpp's GBNF is not read), from a
    /// file; its `start` rule is the whole answer.
    #[arg(long, value_name = "PATH")]
    pub grammar_file: Option<PathBuf>,
    /// A regular expression the whole answer matches (Rust `regex` syntax).
    #[arg(long, value_name = "REGEX")]
    pub regex: Option<String>,
}

impl GrammarArgs {
    /// The grammar the flags ask for (files read, JSON parsed): checked before the model loads.
    pub fn spec(&self) -> Result<Option<GrammarSpec>> {
        let read = |p: &PathBuf| {
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
        };
        let schema = |text: &str, flag: &str| -> Result<GrammarSpec> {
            let v: serde_json::Value = serde_json::from_str(text)
                .with_context(|| format!("{flag}: the schema is not JSON"))?;
            Ok(GrammarSpec::JsonSchema(v))
        };
        Ok(if let Some(s) = &self.json_schema {
            Some(schema(s, "--json-schema")?)
        } else if let Some(p) = &self.json_schema_file {
            Some(schema(&read(p)?, "--json-schema-file")?)
        } else if let Some(p) = &self.grammar_file {
            Some(GrammarSpec::Lark(read(p)?))
        } else {
            self.regex.clone().map(GrammarSpec::Regex)
        })
    }

    /// Compiles `spec` with `c` (built once per tokenizer: [`GrammarCompiler::new`]);
    /// `chat_prompt`: a rendered chat prompt like the ones the answers follow (a thinking
    /// model's reasoning block is then left free).
    pub fn compile(
        spec: &GrammarSpec,
        c: &GrammarCompiler,
        chat_prompt: Option<&str>,
    ) -> Result<Constraint> {
        spec.compile(c, spec.think_after(chat_prompt))
            .map_err(|e| match spec {
                GrammarSpec::Lark(g) if g.contains("::=") => {
                    e.context("--grammar-file reads Lark, and this looks like GBNF (`::=`)")
                }
                _ => e,
            })
    }
}

impl SamplingArgs {
    pub fn params(&self, max_tokens: usize) -> Result<GenParams> {
        anyhow::ensure!(max_tokens > 0, "max tokens (-n) must be at least 1");
        let sampling = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            logit_bias: summed(&self.logit_bias),
        };
        // Validate now so a bad flag is reported before the model loads.
        nibble_engine::Sampler::new(sampling.clone())?;
        Ok(GenParams {
            max_tokens,
            sampling,
            stop_strings: self.stop.clone(),
            greedy_run: self.run.max(1),
            skip_special_tokens: !self.special,
            logprobs: None,
            constraint: None,
            prompt_logprobs: None,
        })
    }
}

/// `ID+BIAS` or `ID-BIAS` (llama.cpp's `--logit-bias`); BIAS a number or `inf`.
fn parse_bias(s: &str) -> Result<(u32, f32), String> {
    let want = || format!("{s:?}: want ID+BIAS or ID-BIAS, e.g. 15043+1 or 15043-inf");
    let at = s.find(['+', '-']).ok_or_else(want)?;
    let id = s[..at].parse::<u32>().map_err(|_| want())?;
    let bias = s[at..].parse::<f32>().map_err(|_| want())?;
    if bias.is_nan() || bias == f32::INFINITY {
        return Err(format!("{s:?}: the bias must be finite or -inf"));
    }
    Ok((id, bias))
}

/// The biases with each id once, repeated ones summed (llama.cpp adds them up).
fn summed(biases: &[(u32, f32)]) -> Vec<(u32, f32)> {
    let mut out: Vec<(u32, f32)> = Vec::new();
    for &(id, b) in biases {
        match out.iter_mut().find(|(i, _)| *i == id) {
            Some((_, sum)) => *sum += b,
            None => out.push((id, b)),
        }
    }
    out
}
