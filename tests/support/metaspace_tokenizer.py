"""A SentencePiece-style tokenizer (Metaspace, byte fallback) built offline for tests: the
shape of Llama 2's and Mistral's tokenizers without their vocabularies."""

from __future__ import annotations

import json
from pathlib import Path

METASPACE_CORPUS = [
    "Hello world, this is a tiny SentencePiece style tokenizer.",
    "The quick brown fox jumps over the lazy dog. Spaces matter here!",
    "leading and trailing spaces, tabs\tand new\nlines; numbers 12345 and punctuation?!",
    "café au lait is a drink; naïve résumé façade",
] * 4


def build_metaspace_tokenizer(directory: Path, decoder: str = "metaspace") -> Path:
    """A deterministic SentencePiece-like tokenizer: BPE over "▁"-prefixed words (Metaspace,
    prepend_scheme "first"), byte fallback tokens <0x00>..<0xFF> for anything else (CJK, emoji),
    and a few special tokens. Saved as a Hugging Face tokenizer directory.

    decoder "metaspace": ByteFallback then Metaspace (strips the first token's "▁");
    decoder "llama": Llama 2's Replace / ByteFallback / Fuse / Strip sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer_tokenizer.train_from_iterator(
        METASPACE_CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False, special_tokens=[]))
    vocab = dict(sorted(trainer_tokenizer.get_vocab().items(), key=lambda item: item[1]))
    merges = []
    state = json.loads(trainer_tokenizer.to_str())["model"]
    for merge in state["merges"]:
        merges.append(tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")))
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    if decoder == "metaspace":
        tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(),
                                               decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    else:
        tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                               decoders.Strip(content=" ", left=1, right=0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)
    fast.add_special_tokens({"additional_special_tokens": ["<|end|>", "<|user|>"]})
    fast.add_tokens(["<think>", "</think>"])
    fast.save_pretrained(str(directory))
    return directory
