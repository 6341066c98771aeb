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
