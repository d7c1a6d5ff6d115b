//! Next-token selection from one row of logits.
//!
//! Pipeline, in Hugging Face `generate` order:
//! 0. the logit bias (OpenAI's `logit_bias`, llama.cpp's `--logit-bias`) is added to the raw
//!    logits of the ids it names; `-inf` bans an id;
//! 1. penalties on ids seen in `history` (the caller chooses the window):
//!    repetition (HF `RepetitionPenaltyLogitsProcessor`: a positive logit is divided by the
//!    penalty, a negative one multiplied, once per distinct id), presence (`-= presence` once per
//!    distinct id) and frequency (`-= count * frequency`), as llama.cpp / OpenAI define them;
//! 2. temperature `<= 0` means greedy: argmax, lowest index on ties;
//! 3. otherwise logits / temperature, then top-k (keep the k largest), softmax, top-p (keep the
//!    smallest prefix of the sorted distribution whose mass reaches p), min-p (keep tokens with
//!    probability >= min_p * max probability), renormalise and draw with a ChaCha8 RNG.
//!
//! Invariants: NaN logits are treated as -inf and never chosen; a row with no finite logit, or an
//! empty row, is an error rather than a guess. History ids outside the row are ignored. The same
//! seed and inputs always give the same ids. Scratch buffers live in the [`Sampler`] so the
//! per-token path does not allocate after the first call.

use std::collections::{BinaryHeap, HashMap, VecDeque};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::error::{Error, Result};
use nibble_backend::DeviceSampling;

/// Sampling configuration; `Default` is greedy decoding with no penalties.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `<= 0` selects greedy decoding.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Nucleus threshold in (0, 1]; 1 disables.
    pub top_p: f32,
    /// Relative probability floor in [0, 1]; 0 disables.
    pub min_p: f32,
    /// HF repetition penalty (> 0); 1 disables.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every id seen in the history; 0 disables.
    pub presence_penalty: f32,
    /// Subtracted `count` times from the logit of every id seen in the history; 0 disables.
    pub frequency_penalty: f32,
    /// RNG seed; `None` seeds from the operating system.
    pub seed: Option<u64>,
    /// `(id, bias)` pairs added to those ids' logits before everything else; each id at most
    /// once, each bias within ±1e6 or `-inf` (a ban). Empty disables. Any bias makes the request
    /// non-greedy for the backends: no device path adds it, so each step's logits come to
    /// the host.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// llama.cpp's default sampler settings (T 0.8, top-k 40, top-p 0.95, min-p 0.05), seeded:
    /// what `nibble bench --sampled` and the sampler bench measure.
    pub fn llama_cpp_defaults(seed: u64) -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            seed: Some(seed),
            ..Self::default()
        }
    }

    /// Qwen3's recommended thinking-mode settings (T 0.6, top-p 0.95, top-k 20, min-p 0).
    pub fn qwen3_thinking() -> Self {
        Self {
            temperature: 0.6,
            top_k: 20,
            top_p: 0.95,
            ..Self::default()
        }
    }

    /// Qwen3's recommended non-thinking settings (T 0.7, top-p 0.8, top-k 20, min-p 0).
    pub fn qwen3_non_thinking() -> Self {
        Self {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.8,
            ..Self::default()
        }
    }

    fn validate(&self) -> Result<()> {
        let bad =
            |what: &str, v: f32| Err(Error::Sampling(format!("{what} = {v} is out of range")));
        if !self.temperature.is_finite() {
            return bad("temperature", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p (want 0 < p <= 1)", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p (want 0..=1)", self.min_p);
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad("repetition_penalty (want > 0)", self.repetition_penalty);
        }
        if !self.presence_penalty.is_finite() {
            return bad("presence_penalty", self.presence_penalty);
        }
        if !self.frequency_penalty.is_finite() {
            return bad("frequency_penalty", self.frequency_penalty);
        }
        let mut seen = std::collections::HashSet::new();
        for &(id, b) in &self.logit_bias {
            // Bounded so the penalties cannot carry a biased logit to infinity (1e38 under a
            // repetition penalty of 0.5 became inf and lost); -inf is a ban.
            if !(b.abs() <= MAX_BIAS || b == f32::NEG_INFINITY) {
                return Err(Error::Sampling(format!(
                    "logit bias {b} for token {id} is out of range (want |bias| <= 1e6, or -inf)"
                )));
            }
            if !seen.insert(id) {
                return Err(Error::Sampling(format!(
                    "token {id} is given a logit bias twice"
                )));
            }
        }
        Ok(())
    }

    /// These settings as a device sampler takes them ([`Sampler::device_sampling`]).
    pub fn device_sampling<'a>(
        &'a self,
        history: &'a [u32],
        draws: &'a [f64],
    ) -> DeviceSampling<'a> {
        DeviceSampling {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias: &self.logit_bias,
            history,
            uniforms: draws,
        }
    }

    fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }

    /// Whether the row is changed before selection: penalties or a logit bias.
    fn reshapes_row(&self) -> bool {
        self.has_penalties() || !self.logit_bias.is_empty()
    }

    /// The first id of the logit bias that is not below `vocab` (a request the row cannot
    /// serve), if any.
    pub fn bias_outside(&self, vocab: usize) -> Option<u32> {
        self.logit_bias
            .iter()
            .map(|&(id, _)| id)
            .find(|&id| id as usize >= vocab)
    }
}

/// Largest finite logit bias: far beyond any logit, far below f32's range.
const MAX_BIAS: f32 = 1e6;

/// Picks token ids from logits according to [`SamplingParams`].
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Draws taken from `rng` ahead of use for a device sampler ([`Sampler::draw_uniforms`]),
    /// in order; [`Sampler::sample`] uses these first, so the ids do not depend on how many
    /// steps the device took before the host samples again ([`Sampler::consume_draws`]).
    pending: VecDeque<f64>,
    /// Penalised copy of the logits row (len = vocab; only with penalties).
    scratch: Vec<f32>,
    /// Candidate (id, logit-or-probability) pairs: sorted by descending value after a streamed
    /// top-k (k <= 256); otherwise in id order, or partitioned by a larger top-k; `nucleus`
    /// then sets its own order.
    candidates: Vec<(u32, f64)>,
    /// A spare candidate vector for `nucleus`, kept to reuse its allocation.
    edge: Vec<(u32, f64)>,
    /// Occurrence count per history id.
    counts: HashMap<u32, u32>,
    /// The streamed top-k's heap (at most `top_k` entries).
    top: BinaryHeap<Kept>,
}

/// Largest top-k kept in a heap during one pass over the row; a larger k partitions a copy of
/// the whole row instead.
const TOP_K_STREAMED: usize = 256;

/// A logit kept by the streamed top-k, ordered so that the heap's top (its greatest element) is
/// the worst kept: the smallest finite value, and of equal values the highest id.
#[derive(Debug, Clone, Copy)]
struct Kept(u32, f32);

impl Ord for Kept {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.1.total_cmp(&self.1).then(self.0.cmp(&other.0))
    }
}
impl PartialOrd for Kept {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Kept {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}
impl Eq for Kept {}

/// Candidates per parallel chunk of the softmax: big enough that a chunk's work (~4096 f64
/// exps) outweighs handing it to a thread, small enough to spread a vocabulary over 16 cores.
const PAR_CHUNK: usize = 4096;

/// Replace each candidate's scaled logit by `exp(value - max)` and return their sum, in order.
fn exp_chunk(ch: &mut [(u32, f64)], max: f64) -> f64 {
    let mut sum = 0.0;
    for c in ch {
        c.1 = (c.1 - max).exp();
        sum += c.1;
    }
    sum
}

/// Largest bin of the top-p boundary that [`Sampler::nucleus`] sorts rather than re-bins.
const NUCLEUS_SORTED: usize = 2048;

/// `total_cmp` ordering for descending values with ascending ids on ties.
fn by_value_desc(a: &(u32, f64), b: &(u32, f64)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

impl Sampler {
    /// Creates a sampler; rejects out-of-range parameters.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = match params.seed {
            Some(seed) => ChaCha8Rng::seed_from_u64(seed),
            None => ChaCha8Rng::from_rng(&mut rand::rng()),
        };
        Ok(Self {
            params,
            rng,
            pending: VecDeque::new(),
            scratch: Vec::new(),
            candidates: Vec::new(),
            edge: Vec::new(),
            counts: HashMap::new(),
            top: BinaryHeap::new(),
        })
    }

    /// Plain argmax with no penalties or bias: a backend's folded greedy run yields the same ids.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0 && !self.params.reshapes_row()
    }

    /// The parameters in use.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Chooses the next id from `logits` (one row, len = vocab); `history` holds the ids the
    /// penalties look at (prompt and/or generated tokens).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32> {
        self.sample_drawn(logits, history, None)
    }

    /// [`Sampler::sample`] with the uniform draw `u` in `[0, 1)` given instead of taken from
    /// the sampler's RNG (which is left as it is): what a device sampler fed the same draws
    /// ([`Sampler::draw_uniforms`]) must reproduce.
    pub fn sample_with_uniform(&mut self, logits: &[f32], history: &[u32], u: f64) -> Result<u32> {
        self.sample_drawn(logits, history, Some(u))
    }

    /// The next `n` draws [`Sampler::sample`] would make, one per sampled token, for a device
    /// sampler to use in order: they stay reserved (the host's next samples use them first)
    /// until [`Sampler::consume_draws`] says how many the device used. All zero when sampling
    /// is greedy (`temperature <= 0`), which draws nothing.
    pub fn draw_uniforms(&mut self, n: usize) -> Vec<f64> {
        if self.params.temperature <= 0.0 {
            return vec![0.0; n];
        }
        while self.pending.len() < n {
            self.pending.push_back(self.rng.random::<f64>());
        }
        self.pending.iter().take(n).copied().collect()
    }

    /// The device used the first `n` reserved draws (one per id it sampled).
    pub fn consume_draws(&mut self, n: usize) {
        let n = n.min(self.pending.len());
        self.pending.drain(..n);
    }

    /// These settings as a device sampler takes them, with the penalty `history` (the fed
    /// token included) and the `draws` of [`Sampler::draw_uniforms`].
    pub fn device_sampling<'a>(
        &'a self,
        history: &'a [u32],
        draws: &'a [f64],
    ) -> DeviceSampling<'a> {
        self.params.device_sampling(history, draws)
    }

    fn sample_drawn(&mut self, logits: &[f32], history: &[u32], u: Option<f64>) -> Result<u32> {
        if logits.is_empty() {
            return Err(Error::Sampling("empty logits row".into()));
        }
        if u32::try_from(logits.len()).is_err() {
            return Err(Error::Sampling(format!(
                "{} logits do not fit u32 ids",
                logits.len()
            )));
        }
        if let Some(id) = self.params.bias_outside(logits.len()) {
            return Err(Error::Sampling(format!(
                "logit bias for token {id} is outside the row of {} logits",
                logits.len()
            )));
        }
        // The bias and penalties work on a copy; without them the row is read as it is (every
        // step below skips non-finite values, NaN included, so NaN is never picked).
        let mut scratch = std::mem::take(&mut self.scratch);
        let row = if self.params.reshapes_row() {
            scratch.clear();
            scratch.extend(
                logits
                    .iter()
                    .map(|&x| if x.is_nan() { f32::NEG_INFINITY } else { x }),
            );
            for &(id, b) in &self.params.logit_bias {
                scratch[id as usize] += b;
            }
            if self.params.has_penalties() {
                self.apply_penalties(&mut scratch, history);
            }
            &scratch[..]
        } else {
            logits
        };
        let id = if self.params.temperature <= 0.0 {
            Self::argmax(row)
        } else {
            self.sample_distribution(row, u)
        };
        self.scratch = scratch;
        id
    }

    fn apply_penalties(&mut self, row: &mut [f32], history: &[u32]) {
        self.counts.clear();
        for &id in history {
            if (id as usize) < row.len() {
                *self.counts.entry(id).or_insert(0) += 1;
            }
        }
        let p = &self.params;
        for (&id, &count) in &self.counts {
            let x = &mut row[id as usize];
            if *x > 0.0 {
                *x /= p.repetition_penalty;
            } else {
                *x *= p.repetition_penalty;
            }
            *x -= p.presence_penalty + count as f32 * p.frequency_penalty;
        }
    }

    /// Keep the nucleus of the normalised candidates: the most likely ones, in descending order,
    /// up to the first whose running mass reaches `top_p`. Sorting a whole row (~150k) took
    /// ~10 ms per token, so the candidates are first binned by the binary exponent of their
    /// probability (bins a factor of 2 wide, most likely first); the bins above the one where
    /// the mass crosses `top_p` are kept whole, in id order (a draw over the kept set does not
    /// depend on their order), and only the crossing bin goes on: re-binned by the next 8
    /// mantissa bits while it holds more than [`NUCLEUS_SORTED`] candidates (a nearly flat row
    /// puts everything in one exponent bin), then sorted. The mass before the crossing is
    /// summed per bin, so a set at the boundary may differ from a full sort's by rounding.
    fn nucleus(&mut self, top_p: f64) {
        let mut pool = std::mem::take(&mut self.candidates);
        let mut kept = std::mem::take(&mut self.edge);
        kept.clear();
        let mut acc = 0.0;
        let mut mass = Vec::new();
        for level in 0..=6u32 {
            // Level 0: the exponent field (1023: [1, 2), bin 0); then 8 mantissa bits a level,
            // larger bits first. Every candidate of a level's pool shares the bits above.
            let (shift, mask, top) = if level == 0 {
                (52, 0x7ff, 1023)
            } else {
                (52 - 8 * level, 0xff, 255)
            };
            let bin = |p: f64| top - (((p.to_bits() >> shift) & mask) as usize).min(top);
            mass.clear();
            mass.resize(top + 1, 0f64);
            for c in &pool {
                mass[bin(c.1)] += c.1;
            }
            let mut before = acc;
            let Some(cross) = mass.iter().position(|&m| {
                let reached = before + m >= top_p;
                if !reached {
                    before += m;
                }
                reached
            }) else {
                // The pool's mass fell short of top_p by rounding: all of it stays.
                kept.append(&mut pool);
                self.candidates = kept;
                self.edge = pool;
                return;
            };
            acc = before;
            let mut edge = Vec::new();
            for &c in &pool {
                match bin(c.1).cmp(&cross) {
                    std::cmp::Ordering::Less => kept.push(c),
                    std::cmp::Ordering::Equal => edge.push(c),
                    std::cmp::Ordering::Greater => {}
                }
            }
            pool = edge;
            if pool.len() <= NUCLEUS_SORTED {
                break;
            }
        }
        pool.sort_unstable_by(by_value_desc);
        for &c in &pool {
            kept.push(c);
            acc += c.1;
            if acc >= top_p {
                break;
            }
        }
        self.candidates = kept;
        self.edge = pool;
    }

    /// Index of the largest finite logit, lowest index on ties.
    fn argmax(row: &[f32]) -> Result<u32> {
        let mut best: Option<(usize, f32)> = None;
        for (i, &x) in row.iter().enumerate() {
            if x.is_finite() && best.is_none_or(|(_, b)| x > b) {
                best = Some((i, x));
            }
        }
        best.map(|(i, _)| i as u32)
            .ok_or_else(|| Error::Sampling("no finite logit to choose from".into()))
    }

    fn sample_distribution(&mut self, row: &[f32], u: Option<f64>) -> Result<u32> {
        let temperature = f64::from(self.params.temperature);
        self.candidates.clear();
        let k = self.params.top_k;
        if k > 0 && k <= TOP_K_STREAMED {
            // Top-k in one pass over the row (a vocabulary is ~150k logits, k tens): a
            // bounded heap whose top is the worst kept logit; almost every logit fails the one
            // comparison with it. Same set as sorting everything by `by_value_desc` (values
            // descending, lower id first on ties: a later id never displaces an equal value).
            self.top.clear();
            // The worst kept value once the heap is full (+inf before: nothing passes it).
            let mut floor = f32::INFINITY;
            for (i, &x) in row.iter().enumerate() {
                if x > floor || (self.top.len() < k && x.is_finite()) {
                    if x == f32::INFINITY {
                        continue;
                    }
                    if self.top.len() == k {
                        self.top.pop();
                    }
                    self.top.push(Kept(i as u32, x));
                    if self.top.len() == k {
                        floor = self.top.peek().map_or(f32::INFINITY, |w| w.1);
                    }
                }
            }
            self.candidates
                .extend(self.top.iter().map(|c| (c.0, f64::from(c.1) / temperature)));
            self.candidates.sort_unstable_by(by_value_desc);
        } else {
            self.candidates.extend(
                row.iter()
                    .enumerate()
                    .filter(|(_, x)| x.is_finite())
                    .map(|(i, &x)| (i as u32, f64::from(x) / temperature)),
            );
            // Top-k: partition first so only k elements need sorting.
            if k > 0 && k < self.candidates.len() {
                self.candidates.select_nth_unstable_by(k - 1, by_value_desc);
                self.candidates.truncate(k);
            }
        }
        if self.candidates.is_empty() {
            return Err(Error::Sampling("no finite logit to choose from".into()));
        }
        // Softmax over the survivors (max-subtracted for stability). A whole row (~150k
        // candidates when top-k is off, OpenAI's defaults) is worked in fixed chunks over the
        // rayon pool: the exps are most of a sampled step's host time, and the chunk sums are
        // added in chunk order, so the total does not depend on the thread count.
        let max = self
            .candidates
            .iter()
            .map(|c| c.1)
            .fold(f64::NEG_INFINITY, f64::max);
        let total: f64 = if self.candidates.len() >= 2 * PAR_CHUNK {
            let sums: Vec<f64> = self
                .candidates
                .par_chunks_mut(PAR_CHUNK)
                .map(|ch| exp_chunk(ch, max))
                .collect();
            sums.iter().sum()
        } else {
            exp_chunk(&mut self.candidates, max)
        };
        let inv = 1.0 / total;
        if self.candidates.len() >= 2 * PAR_CHUNK {
            self.candidates
                .par_chunks_mut(PAR_CHUNK)
                .for_each(|ch| ch.iter_mut().for_each(|c| c.1 *= inv));
        } else {
            self.candidates.iter_mut().for_each(|c| c.1 *= inv);
        }

        // Top-p: the smallest set of most likely tokens whose mass reaches p (at least one).
        let top_p = f64::from(self.params.top_p);
        if top_p < 1.0 {
            self.nucleus(top_p);
        }

        // Min-p: relative to the most likely token, whose weight is exp(max - max) / total.
        let min_p = f64::from(self.params.min_p);
        if min_p > 0.0 {
            let floor = min_p / total;
            self.candidates.retain(|c| c.1 >= floor);
        }

        // Draw from the renormalised survivors.
        let mass: f64 = self.candidates.iter().map(|c| c.1).sum();
        let u = u.unwrap_or_else(|| match self.pending.pop_front() {
            Some(d) => d,
            None => self.rng.random::<f64>(),
        });
        let mut u = u * mass;
        for c in &self.candidates {
            if u < c.1 {
                return Ok(c.0);
            }
            u -= c.1;
        }
        // Rounding left `u` just past the end: the last survivor is the right answer.
        self.candidates
            .last()
            .map(|c| c.0)
            .ok_or_else(|| Error::Sampling("no candidate survived filtering".into()))
    }
}

#[cfg(test)]
#[path = "sampler_tests.rs"]
mod tests;
