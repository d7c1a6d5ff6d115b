//! `nibble chat`: interactive multi-turn chat that keeps the KV cache between turns.
//!
//! Each turn re-renders the whole conversation with the model's template; the session keeps the
//! longest common prefix of the cache, so only the new turn is prefilled.

use crate::backends::{self, BackendArgs};
use crate::sampling_args::SamplingArgs;
use anyhow::{anyhow, Result};
use nibble_engine::session::Session;
use nibble_engine::{ChatTemplate, Message};
use std::io::{BufRead, Write};
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
    let params = a.sampling.params(a.max_tokens)?;
    let model = nibble_model::loader::open(&a.model)?;
    let tok = crate::tokenizer::required(&model)?;
    let tpl = ChatTemplate::new(model.chat_template.as_deref().ok_or_else(|| {
        anyhow!(
            "{}: chat needs a chat template and the model has none",
            a.model.display()
        )
    })?)?;
    let mut session = Session::new(backends::make(&a.backend, model.weights.clone())?);
    let mut msgs = vec![];
    if let Some(s) = &a.system {
        msgs.push(Message::system(s.clone()));
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
        if line == "/exit" || line == "/quit" {
            break;
        }
        msgs.push(Message::user(line.to_string()));
        let mut answer = String::new();
        let prompt = tpl.render(&msgs, true, a.no_think.then_some(false), None);
        let stats = prompt.map_err(anyhow::Error::from).and_then(|prompt| {
            let ids = tok.encode_within(&prompt, session.backend().context_len())?;
            session.generate(&tok, &ids, &params, &mut |t| {
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
                eprintln!(
                    "error: {e:#}\n[this message is dropped; the chat goes on, /exit ends it]"
                );
                if interactive {
                    write!(out, "> ")?;
                    out.flush()?;
                }
                continue;
            }
        };
        // A stdout that cannot be written ends the chat.
        writeln!(out)?;
        turn += 1;
        eprintln!(
            "[turn {}: prompt {} tokens ({} reused from cache), generated {}, decode {:.1} tok/s, {}]",
            turn,
            stats.prompt_tokens,
            stats.cached_tokens,
            stats.generated.len(),
            stats.decode_tps(),
            crate::cmd_generate::describe(&stats.finish)
        );
        msgs.push(Message::assistant(answer));
        if interactive {
            write!(out, "> ")?;
            out.flush()?;
        }
    }
    Ok(())
}
