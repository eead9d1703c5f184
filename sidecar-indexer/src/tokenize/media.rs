//! Where a chat prompt with media stops being known: the first byte of the rendered prompt that
//! depends on the first message holding media parts.
//!
//! vLLM writes a media item's placeholder into its message's content (in front of the text, see
//! `kvmesh_core::openai::media`), and the model's processor expands it into a processor-specific
//! number of tokens keyed by the item's identifier — neither of which the indexer can reproduce
//! (the identifier is a hash of the decoded media unless the client names it, and the token count
//! depends on the image). So the index's view of such a prompt ends where that message's content
//! begins: the prompt is tokenized as its text (the memo skipped), and its chains stop at the
//! start of the segment (between two added tokens) holding that byte. Blocks before are exact;
//! none after is ever predicted a hit — nor recorded as a speculative holding. The engine keys its
//! own blocks there by the media (`extra_keys`), so no text-only prompt matches them either.
//!
//! The byte is found without knowing the template: the prompt is rendered once more with that
//! message's content changed (a control character in front), and the first byte where the two
//! renderings differ is where the content first shows (earlier if the template reads the content
//! before writing it: an earlier stop, never a later one).

use kvmesh_core::openai::ChatMessage;
use kvmesh_tokens::ChatTemplate;

use super::TokenizeError;

/// The first byte of `text` (the rendering of `messages`) that depends on message `first`'s
/// content; 0 (nothing is known) when the two renderings do not differ.
pub(super) fn cut_byte(
    template: &ChatTemplate,
    messages: &[ChatMessage],
    first: usize,
    text: &str,
) -> Result<usize, TokenizeError> {
    let Some(m) = messages.get(first) else { return Ok(0) };
    let mut marked = messages.to_vec();
    marked[first] =
        ChatMessage { role: m.role.clone(), content: format!("\u{1}{}", m.content).into() };
    let other = template.render(&marked, true)?;
    Ok(text.bytes().zip(other.bytes()).position(|(a, b)| a != b).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::super::{CacheStats, PromptTokenizer, Reach};
    use kvmesh_core::hashing::SequenceHash;
    use kvmesh_core::openai::{ChatMessage, RequestInput};

    fn load() -> PromptTokenizer {
        let path = kvmesh_tokens::default_tokenizer_path();
        PromptTokenizer::load(&path, None, "<｜begin▁of▁sentence｜>", 8 << 20)
            .unwrap_or_else(|e| panic!("{e} (run `make setup` for the DeepSeek tokenizer)"))
    }

    fn msg(role: &str, content: String) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }

    #[test]
    fn chains_stop_where_the_first_media_message_begins() {
        let tok = load();
        let messages = vec![
            msg("system", "You answer questions about pictures, briefly. ".repeat(30)),
            msg("user", "What is in this picture, and why is it funny? ".repeat(20)),
        ];
        let input = RequestInput::Messages(messages.clone());
        let whole_reach = || Reach::whole_blocks(16, 1337);
        let stats = &mut CacheStats::default();
        let whole = tok.tokens_until(&input, &mut whole_reach(), stats).unwrap();
        assert!(!whole.cut_at_media);
        let cut = tok.tokens_until(&input, &mut whole_reach().media_from(Some(1)), stats).unwrap();
        assert!(cut.cut_at_media);
        // The prompt is still tokenized whole; only its chains stop.
        assert_eq!(cut.ids.to_vec(), whole.ids.to_vec());
        let text = tok.template.render(&messages, true).unwrap();
        let content = text.find(&*messages[1].content).unwrap();
        let before = tok.encode_text(&text[..content], stats).unwrap().len();
        assert!(before / 16 > 10, "a long known prefix: {before} tokens");
        assert_eq!(cut.chains, whole.chains[..before / 16].to_vec());
        assert_eq!(cut.locals, whole.locals[..before / 16].to_vec());
        // A route that finds every block held stops at the same place.
        let mut held = |c: &[SequenceHash]| c.len();
        let routed = tok
            .tokens_until(
                &input,
                &mut Reach::new(16, 1337, 0, &mut held).media_from(Some(1)),
                stats,
            )
            .unwrap();
        assert_eq!(routed.chains, cut.chains);
        assert!(routed.cut_at_media);
        // Media in the first message: nothing before it but the template's own start.
        let first =
            tok.tokens_until(&input, &mut whole_reach().media_from(Some(0)), stats).unwrap();
        assert!(first.chains.len() <= 1, "{}", first.chains.len());
        // Text-only prompts are untouched, and a text-only turn after a media one resumes nothing
        // the media turn left in the memo.
        let again = tok.tokens_until(&input, &mut whole_reach(), stats).unwrap();
        assert_eq!(again, whole);
    }
}
