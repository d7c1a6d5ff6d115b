//! Session bookkeeping against a scripted backend: the KV-cache ids stay consistent with the
//! backend's position whatever ends generation (EOS, stop string mid-run, max_tokens, context),
//! and a follow-up prompt reuses the cached prefix.

mod common;

use anyhow::Result;
use nibble_backend::{Backend, Qwen3MoeConfig};
use nibble_engine::session::{FinishReason, GenParams, Session};
use nibble_engine::{StopReason, Tokenizer};

/// Logits put all mass on `script[(i + 1) % len]` after token `script[i]` (else on script[0]).
struct Scripted {
    cfg: Qwen3MoeConfig,
    script: Vec<u32>,
    cache: Vec<u32>,
    ctx: usize,
}

impl Backend for Scripted {
    fn name(&self) -> String {
        "scripted".into()
    }
    fn config(&self) -> &Qwen3MoeConfig {
        &self.cfg
    }
    fn context_len(&self) -> usize {
        self.ctx
    }
    fn position(&self) -> usize {
        self.cache.len()
    }
    fn truncate(&mut self, pos: usize) -> Result<()> {
        anyhow::ensure!(pos <= self.cache.len());
        self.cache.truncate(pos);
        Ok(())
    }
    fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        anyhow::ensure!(
            self.cache.len() + tokens.len() <= self.ctx,
            "context overflow"
        );
        self.cache.extend_from_slice(tokens);
        let last = *tokens.last().unwrap();
        let next = match self.script.iter().position(|&t| t == last) {
            Some(i) => self.script[(i + 1) % self.script.len()],
            None => self.script[0],
        };
        let mut l = vec![0f32; self.cfg.vocab_size];
        l[next as usize] = 10.0;
        Ok(l)
    }
}

fn setup(text: &str, ctx: usize) -> Option<(Tokenizer, Session, Vec<u32>)> {
    let tok = Tokenizer::from_hf_dir(common::tokenizer_dir()?).unwrap();
    let script = tok.encode(text).unwrap();
    let b = Scripted {
        cfg: Qwen3MoeConfig::tiny(),
        script: script.clone(),
        cache: vec![],
        ctx,
    };
    Some((tok, Session::new(Box::new(b)), script))
}

fn gen(s: &mut Session, tok: &Tokenizer, prompt: &[u32], p: &GenParams) -> (String, FinishReason) {
    let mut out = String::new();
    let st = s
        .generate(tok, prompt, p, &mut |t, _| {
            out.push_str(t);
            true
        })
        .unwrap();
    assert_eq!(
        s.cached().len(),
        s.backend().position(),
        "cache ids out of step with the backend"
    );
    (out, st.finish)
}

#[test]
fn stop_string_inside_a_run_keeps_the_cache_consistent() {
    let Some((tok, mut s, script)) = setup(" one two three four five six seven eight", 4096) else {
        return;
    };
    let p = GenParams {
        max_tokens: 100,
        stop_strings: vec![" five".into()],
        greedy_run: 16,
        ..Default::default()
    };
    let (out, finish) = gen(&mut s, &tok, &script[..1], &p);
    assert_eq!(out, " two three four");
    assert_eq!(finish, FinishReason::Stop(StopReason::StopString(0)));
    // The cache holds the prompt and the shown tokens that were fed back, never the stopped ones.
    let shown = tok.encode(" one two three four").unwrap();
    assert!(
        shown.starts_with(s.cached()) && s.cached().len() >= 2,
        "{:?}",
        s.cached()
    );
}

#[test]
fn max_tokens_and_context_limits() {
    let Some((tok, mut s, script)) = setup(" a b c d e f g h i j", 4096) else {
        return;
    };
    let p = GenParams {
        max_tokens: 7,
        greedy_run: 3,
        ..Default::default()
    };
    let (out, finish) = gen(&mut s, &tok, &script[..2], &p);
    assert_eq!(out, " c d e f g h i");
    assert_eq!(finish, FinishReason::Length);
    let Some((tok, mut s, script)) = setup(" a b c d e f g h i j", 6) else {
        return;
    };
    let (out, finish) = gen(
        &mut s,
        &tok,
        &script[..2],
        &GenParams {
            max_tokens: 100,
            ..Default::default()
        },
    );
    assert_eq!(finish, FinishReason::ContextFull);
    assert_eq!(out, " c d e f g");
    assert_eq!(s.cached().len(), 6);
}

#[test]
fn eos_stops_and_follow_up_reuses_the_prefix() {
    let Some((tok, _, mut script)) = setup(" x y z", 4096) else {
        return;
    };
    script.push(151645); // <|im_end|> after " z"
    let b = Scripted {
        cfg: Qwen3MoeConfig::tiny(),
        script: script.clone(),
        cache: vec![],
        ctx: 4096,
    };
    let mut s = Session::new(Box::new(b));
    let p = GenParams {
        max_tokens: 50,
        greedy_run: 2,
        ..Default::default()
    };
    let (out, finish) = gen(&mut s, &tok, &script[..1], &p);
    assert_eq!(out, " y z");
    assert_eq!(finish, FinishReason::Stop(StopReason::Eos(151645)));
    // A longer prompt that starts with what is cached reuses it.
    let mut follow = s.cached().to_vec();
    follow.extend(tok.encode(" again x").unwrap());
    let before = s.cached().len();
    let st = s.generate(&tok, &follow, &p, &mut |_, _| true).unwrap();
    assert_eq!(st.cached_tokens, before);
    // Sampled (non-greedy) path keeps the same invariant.
    let mut sp = p.clone();
    sp.sampling.temperature = 0.5;
    sp.sampling.seed = Some(1);
    let (_, _) = gen(&mut s, &tok, &follow, &sp);
}

/// Logprob entries come with the text of their ids: each piece hands over the entries of the
/// ids produced since the previous piece (a character split over ids with the piece that
/// completes it), and every entry is handed over once, a stop string's included.
#[test]
fn logprob_entries_come_with_their_text() {
    let text = "Once upon a time, the caf\u{e9} \u{1D11E} sold tea END now.";
    let Some((tok, mut s, script)) = setup(text, 4096) else {
        return;
    };
    let p = GenParams {
        max_tokens: 100,
        logprobs: Some(1),
        stop_strings: vec!["END".into()],
        ..Default::default()
    };
    let mut pieces: Vec<(String, Vec<u32>)> = vec![];
    let st = s
        .generate(&tok, &script[..2], &p, &mut |t, lp| {
            pieces.push((t.to_owned(), lp.iter().map(|e| e.id).collect()));
            true
        })
        .unwrap();
    assert_eq!(st.finish, FinishReason::Stop(StopReason::StopString(0)));
    let handed: Vec<u32> = pieces.iter().flat_map(|p| p.1.clone()).collect();
    assert_eq!(handed, st.generated);
    let entries: Vec<u32> = st.logprobs.iter().map(|e| e.id).collect();
    assert_eq!(entries, st.generated);
    // The split character came in one piece with all its ids.
    assert!(pieces
        .iter()
        .any(|(t, ids)| t.contains('\u{1D11E}') && ids.len() >= 2));
    // Before the stop string, the text so far is exactly what the ids handed so far decode to,
    // less a character they end inside of (no other text is held back there: nothing before
    // "END" could start it).
    let (mut ids, mut shown) = (vec![], String::new());
    for (t, lp) in &pieces {
        ids.extend_from_slice(lp);
        shown.push_str(t);
        let decoded = tok.decode(&ids);
        let decoded = decoded.trim_end_matches('\u{FFFD}');
        if decoded.contains("END") {
            assert!(decoded.starts_with(&shown), "{decoded:?} vs {shown:?}");
        } else {
            assert!(!t.is_empty());
            assert_eq!(decoded, shown);
        }
    }
    assert_eq!(shown, " a time, the caf\u{e9} \u{1D11E} sold tea ");
}
