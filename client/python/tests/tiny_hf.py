"""A tiny Hugging Face model folder made offline: a byte-level BPE tokenizer trained with
`tokenizers` on a few lines (with a ChatML-style chat template and <s>, </s>, <pad>,
<|im_start|>, <|im_end|> as special tokens) and a Llama model with random weights sized to it.

Used by tests/test_prepare.py and tests/service/guide_test.py (which runs docs/guide.md on it).
Run as a script to make one: python tiny_hf.py FOLDER."""
import os
import sys

CORPUS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "What is the capital of France? The capital of France is Paris.",
    "Say hello politely. Hello, it is a pleasure to meet you!",
    "Count to five: one, two, three, four, five.",
    "The quick brown fox jumps over the lazy dog 0123456789.",
]

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

# ChatML: each turn is <|im_start|>ROLE\nCONTENT<|im_end|>\n; the generation prompt opens an
# assistant turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer(folder, vocab_size=320):
    """Trains the BPE and saves it (tokenizer.json + tokenizer_config.json) into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHAT_TEMPLATE
    os.makedirs(folder, exist_ok=True)
    tok.save_pretrained(folder)
    return tok


def make_model(folder, tok, seed=0):
    """A 2-layer Llama with random weights whose vocabulary holds every token of `tok`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, torch_dtype="float32")
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    model.generation_config.save_pretrained(folder)
    return model


def make_tiny_llama(folder, seed=0):
    tok = make_tokenizer(folder)
    make_model(folder, tok, seed)
    return folder


if __name__ == "__main__":
    print(make_tiny_llama(sys.argv[1]))
