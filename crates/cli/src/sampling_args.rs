//! Sampling, stop and output flags shared by `generate` and `chat`.

use anyhow::Result;
use nibble_engine::session::GenParams;
use nibble_engine::SamplingParams;

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
}

impl SamplingArgs {
    pub fn params(&self, max_tokens: usize) -> Result<GenParams> {
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
