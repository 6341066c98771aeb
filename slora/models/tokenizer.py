"""Loading the tokenizer that sits beside a model, if there is one."""
import logging
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, or None when it has none (then prompts must be token ids)."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        logger.warning("no tokenizer in %s: prompts must be token ids and outputs have no text", folder)
        return None
    return AutoTokenizer.from_pretrained(str(folder))


def eos_token_ids(model_eos: tuple[int, ...], tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """The ids that end a sequence: the model config's and the tokenizer's."""
    ids = set(model_eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
