//! `nibble chat`: interactive multi-turn chat that keeps the KV cache between turns.
//!
//! Each turn re-renders the whole conversation with the model's template; the session keeps the
//! longest common prefix of the cache, so only the new turn is prefilled. A conversation that
//! would leave less than an answer's room in the context (`-n`, at most half the context) drops
//! its oldest exchanges first, the system message kept, as chat front ends truncate history;
//! the dropped ones are named on stderr. `/reset` (or `/clear`) starts over, `/help` lists the
//! commands, `/exit` (or `/quit`, or the end of input) ends.

use crate::backends::{self, BackendArgs};
use crate::sampling_args::{GrammarArgs, SamplingArgs};
use anyhow::{anyhow, bail, Result};
use nibble_engine::session::{FinishReason, Session};
use nibble_engine::{ChatTemplate, Message, Tokenizer};
use nibble_engine::{GrammarCompiler, StopReason};
use std::io::{BufRead, Write};
use std::ops::Range;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Model: a .gguf file or a Hugging Face directory.
    #[arg(short, long)]
    model: PathBuf,
    /// Tokens per answer at most.
    #[arg(short = 'n', long, default_value_t = 256)]
    max_tokens: usize,
    /// A system message.
    #[arg(long)]
    system: Option<String>,
    /// Disable thinking (Qwen3 `enable_thinking=false`).
    #[arg(long)]
    no_think: bool,
    #[command(flatten)]
    backend: BackendArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
}

pub fn run(a: Args) -> Result<()> {
    a.backend.check_flags()?;
    if a.max_tokens == 0 {
        bail!("-n must be at least 1: every answer needs a token");
    }
    let mut params = a.sampling.params(a.max_tokens)?;
    let grammar = a.sampling.grammar.spec()?;
    let model = crate::backends::open_model(&a.model, &a.backend)?;
    let tok = crate::tokenizer::required(&model)?;
    let tpl = ChatTemplate::new(model.chat_template.as_deref().ok_or_else(|| {
        anyhow!(
            "{}: chat needs a chat template and the model has none",
            a.model.display()
        )
    })?)?;
    let vocab = model.weights.config().vocab_size;
    if let Some(id) = params.sampling.bias_outside(vocab) {
        bail!("--logit-bias {id}: the id is outside the model's vocabulary of {vocab}");
    }
    let mut session = Session::new(backends::make(&a.backend, model.weights.clone())?);
    if let Some(spec) = &grammar {
        // Every turn's prompt ends as this one does (open or closed thinking).
        let probe = tpl.render(
            &[Message::user(String::new())],
            true,
            a.no_think.then_some(false),
            None,
        )?;
        let c = GrammarCompiler::new(&tok, &session.backend().config().eos_token_ids)?;
        params.constraint = Some(GrammarArgs::compile(spec, &c, Some(&probe))?);
    }
    let mut msgs = vec![];
    if let Some(s) = &a.system {
        msgs.push(Message::system(s.clone()));
        // A system message that leaves no room for any message would fail every turn.
        let ctx = session.backend().context_len();
        let probe = [msgs[0].clone(), Message::user(String::new())];
        let text = tpl.render(&probe, true, a.no_think.then_some(false), None)?;
        let n = tok
            .encode_within(&text, ctx)
            .map_or(usize::MAX, |ids| ids.len());
        if n >= ctx {
            bail!("the --system message takes {} of the context's {ctx} tokens, leaving none for the conversation", if n == usize::MAX { "more than all".to_owned() } else { n.to_string() });
        }
    }
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    let interactive = std::io::IsTerminal::is_terminal(&stdin);
    let mut input = stdin.lock();
    let mut buf = Vec::new();
    let mut turn = 0;
    loop {
        buf.clear();
        if input.read_until(b'\n', &mut buf)? == 0 {
            break;
        }
        // Bytes that are not UTF-8 become U+FFFD rather than ending the chat.
        let line = String::from_utf8_lossy(&buf);
        let line = line.trim_end();
        if line.is_empty() {
            continue;
        }
        let command = line.trim().to_ascii_lowercase();
        match command.as_str() {
            "/exit" | "/quit" => break,
            "/reset" | "/clear" => {
                msgs.truncate(usize::from(a.system.is_some()));
                note!("[the conversation is cleared]");
                prompt_again(&mut out, interactive)?;
                continue;
            }
            "/help" => {
                note!("{HELP}");
                prompt_again(&mut out, interactive)?;
                continue;
            }
            // A slash and a word that is no command: a typo, not a message.
            c if c.len() > 1
                && c.starts_with('/')
                && c[1..].chars().all(|ch| ch.is_ascii_alphabetic()) =>
            {
                note!(
                    "[unknown command {}: /help lists the commands]",
                    line.trim()
                );
                prompt_again(&mut out, interactive)?;
                continue;
            }
            _ => {}
        }
        msgs.push(Message::user(line.to_string()));
        let mut answer = String::new();
        let ctx = session.backend().context_len();
        let fitted = fit(&tpl, &tok, &msgs, ctx, a.max_tokens, a.no_think);
        let mut cut = 0..0;
        let stats = fitted.and_then(|(ids, c)| {
            cut = c;
            session.generate(&tok, &ids, &params, &mut |t, _| {
                answer.push_str(t);
                out.write_all(t.as_bytes())
                    .and_then(|_| out.flush())
                    .is_ok()
            })
        });
        let stats = match stats {
            Ok(s) => s,
            Err(e) => {
                // One message that cannot be answered (the conversation no longer fits the
                // context, say) is dropped; the chat goes on.
                msgs.pop();
                note!("error: {e:#}\n[this message is dropped; the chat goes on, /exit ends it]");
                prompt_again(&mut out, interactive)?;
                continue;
            }
        };
        // A stdout that cannot be written ends the chat: quietly where its reader left
        // (`| head`), as `generate` ends; any other failure is an error.
        if let Err(e) = writeln!(out) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                return Ok(());
            }
            return Err(anyhow!(e).context("writing the answer to stdout"));
        }
        if !cut.is_empty() {
            note!(
                "[the conversation outgrew the context of {ctx} tokens: its oldest {} messages are dropped]",
                cut.len()
            );
            msgs.drain(cut);
        }
        turn += 1;
        note!(
            "[turn {}: prompt {} tokens ({} reused from cache), generated {}, decode {:.1} tok/s, {}]",
            turn,
            stats.prompt_tokens,
            stats.cached_tokens,
            stats.generated.len(),
            stats.decode_tps(),
            crate::cmd_generate::describe(&stats.finish)
        );
        // The history holds the answer as shown without --special, so that flag changes what is
        // printed, not what the model sees next turn (an unknown id's `<|unk:ID|>` would come
        // back as plain text). A stop string cut the shown text: that text is kept as it is.
        let stopped_by_string =
            matches!(stats.finish, FinishReason::Stop(StopReason::StopString(_)));
        if !params.skip_special_tokens && !stopped_by_string {
            answer = tok.decode_skipping_special(&stats.generated);
        }
        msgs.push(Message::assistant(answer));
        prompt_again(&mut out, interactive)?;
    }
    Ok(())
}

const HELP: &str = "[commands: /reset (or /clear) starts the conversation over, keeping --system; \
/exit (or /quit, or the end of input) ends; /help shows this. Any other line that is not a slash \
and a word is a message.]";

/// Shows the input prompt again on a terminal.
fn prompt_again(out: &mut impl Write, interactive: bool) -> Result<()> {
    if interactive {
        write!(out, "> ")?;
        out.flush()?;
    }
    Ok(())
}

/// The prompt ids of `msgs` (ending in the new user message), rendered with the generation
/// prompt and leaving room for an answer of `max_tokens` (at most half of the `ctx` positions),
/// and the range of `msgs` left out for it: while the ids do not leave that room, the oldest
/// exchange (a user message and the replies up to the next user message) is left out, the
/// last one too, the system message kept. The new message with no history is returned however long (the session
/// then says it does not fit), so a message that cannot be answered costs no history.
fn fit(
    tpl: &ChatTemplate,
    tok: &Tokenizer,
    msgs: &[Message],
    ctx: usize,
    max_tokens: usize,
    no_think: bool,
) -> Result<(Vec<u32>, Range<usize>)> {
    let room = max_tokens.min(ctx / 2);
    let start = msgs.iter().position(|m| m.role != "system").unwrap_or(0);
    let mut cut = start;
    loop {
        let kept: Vec<Message> = msgs[..start].iter().chain(&msgs[cut..]).cloned().collect();
        let prompt = tpl.render(&kept, true, no_think.then_some(false), None)?;
        // The next user message (the new one at the latest): where the next cut would end.
        let next = (cut + 1..msgs.len()).find(|&i| msgs[i].role == "user");
        match (tok.encode_within(&prompt, ctx), next) {
            (Ok(ids), _) if ids.len() + room <= ctx => return Ok((ids, start..cut)),
            (Ok(ids), None) => return Ok((ids, start..cut)),
            (Err(e), None) => return Err(e.into()),
            (_, Some(n)) => cut = n,
        }
    }
}
