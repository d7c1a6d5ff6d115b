//! `nibble generate`: stream a continuation of one prompt to stdout.

use crate::backends::{self, BackendArgs};
use crate::sampling_args::{GrammarArgs, SamplingArgs};
use anyhow::{anyhow, Result};
use nibble_engine::session::{FinishReason, Session};
use nibble_engine::{ChatTemplate, Message};
use nibble_engine::{GrammarCompiler, StopReason};
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Model: a .gguf file or a Hugging Face directory.
    #[arg(short, long)]
    model: PathBuf,
    /// Prompt text.
    #[arg(short, long, required_unless_present = "file", conflicts_with = "file")]
    prompt: Option<String>,
    /// Read the prompt from a file (`-` for stdin), as llama.cpp's `-f`.
    #[arg(short, long, value_name = "PATH")]
    file: Option<PathBuf>,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 128)]
    max_tokens: usize,
    /// Wrap the prompt as one user turn with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// With --chat: a system message.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// With --chat: disable thinking (Qwen3 `enable_thinking=false`).
    #[arg(long, requires = "chat")]
    no_think: bool,
    #[command(flatten)]
    backend: BackendArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
}

pub fn run(a: Args) -> Result<()> {
    a.backend.check_flags()?;
    let mut params = a.sampling.params(a.max_tokens)?;
    let grammar = a.sampling.grammar.spec()?;
    let prompt = match (&a.prompt, &a.file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => read_prompt(f)?,
        (None, None) => unreachable!("clap requires --prompt or --file"),
    };
    let model = crate::backends::open_model(&a.model, &a.backend)?;
    let tok = crate::tokenizer::required(&model)?;
    let text = if a.chat {
        let tpl = model.chat_template.as_deref().ok_or_else(|| {
            anyhow!(
                "{}: --chat needs a chat template and the model has none",
                a.model.display()
            )
        })?;
        let mut msgs = vec![];
        if let Some(s) = &a.system {
            msgs.push(Message::system(s.clone()));
        }
        msgs.push(Message::user(prompt));
        ChatTemplate::new(tpl)?.render(&msgs, true, a.no_think.then_some(false), None)?
    } else {
        prompt
    };
    let mut session = Session::new(backends::make(&a.backend, model.weights.clone())?);
    let ids = tok.encode_within(&text, session.backend().context_len())?;
    if let Some(spec) = &grammar {
        let c = GrammarCompiler::new(&tok, &session.backend().config().eos_token_ids)?;
        let chat_prompt = a.chat.then_some(text.as_str());
        params.constraint = Some(GrammarArgs::compile(spec, &c, chat_prompt)?);
    }
    let mut out = std::io::stdout().lock();
    let mut write_err = None;
    let stats = session.generate(&tok, &ids, &params, &mut |t, _| match out
        .write_all(t.as_bytes())
        .and_then(|_| out.flush())
    {
        Ok(()) => true,
        Err(e) => {
            write_err = Some(e);
            false
        }
    })?;
    if write_err.is_none() {
        write_err = writeln!(out).err();
    }
    // A reader that left (`| head`) has what it wanted: generation ends quietly. Any other
    // failure (a full disk, a closed stdout) loses the text, so it is an error.
    if let Some(e) = write_err.filter(|e| e.kind() != std::io::ErrorKind::BrokenPipe) {
        return Err(anyhow!(e).context("writing the generated text to stdout"));
    }
    // A failed write to stderr is not worth a panic.
    let _ = writeln!(
        std::io::stderr(),
        "prompt {} tokens, generated {} tokens, prompt {:.1} tok/s, decode {:.1} tok/s ({})",
        stats.prompt_tokens,
        stats.generated.len(),
        stats.prompt_tps(),
        stats.decode_tps(),
        describe(&stats.finish)
    );
    Ok(())
}

/// Why generation ended, in words (`generate`'s summary, `chat`'s turn lines).
pub(crate) fn describe(f: &FinishReason) -> String {
    match f {
        FinishReason::Stop(StopReason::Eos(id)) => format!("end of text, id {id}"),
        FinishReason::Stop(StopReason::StopString(i)) => format!("stop string {}", i + 1),
        FinishReason::Length => "max tokens".into(),
        FinishReason::ContextFull => "context full".into(),
        FinishReason::Cancelled => "output closed".into(),
    }
}

/// The prompt in `path` (`-`: stdin), which must be UTF-8 text.
fn read_prompt(path: &std::path::Path) -> Result<String> {
    let bytes = if path == std::path::Path::new("-") {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut b)
            .map_err(|e| anyhow!("reading the prompt from stdin: {e}"))?;
        b
    } else {
        std::fs::read(path).map_err(|e| anyhow!("reading the prompt {}: {e}", path.display()))?
    };
    String::from_utf8(bytes).map_err(|e| {
        anyhow!(
            "the prompt {} is not UTF-8 text (byte {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}
