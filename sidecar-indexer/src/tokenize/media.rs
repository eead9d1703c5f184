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
    marked[first] = ChatMessage { role: m.role.clone(), content: format!("\u{1}{}", m.content).into() };
    let other = template.render(&marked, true)?;
    Ok(text.bytes().zip(other.bytes()).position(|(a, b)| a != b).unwrap_or(0))
}
