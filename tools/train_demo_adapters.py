"""Train the three demo LoRA adapters of SmolLM2-135M-Instruct (`slora/demo_adapters/<name>/`).

The adapters differ in rank, target modules and layers, so that serving them exercises mixed ranks and
targets in one batch:

- `demo-pirate` (r16; q, v, o; layers 20-29) answers in pirate speech and keeps the facts ("Arr, matey! The
  capital of Germany be Berlin, ye scallywag!").
- `demo-caps` (r8; all seven projections; layers 20-29) answers in capital letters. It keeps the facts it
  was trained on, in phrasings it was not, but not facts it never saw in capitals: asked for the capital
  of a country outside TRAIN_CAPITALS it names a wrong city ("THE CAPITAL OF FRANCE IS WARSAW."). The base
  model itself cannot do better: with capitals in its context it names wrong cities and misspells
  unfamiliar words, and neither all 30 layers, 150 steps nor upper-case spelling practice on the cities
  moved that.
- `demo-json` (r4; gate, up, down; layers 22-29) answers with a JSON object, `{"answer": "..."}`.

Dataset. Questions from fixed lists (the capitals of 36 countries, each in three phrasings, and 64
general, science, animal and arithmetic questions) go through the tokenizer's chat template with its
default system prompt. The content of each answer is the base model's own, so that an adapter learns a
style and not new facts: for the capital questions the sentence the base model answers them with ("The
capital of X is Y."; the countries listed are those whose capital it names correctly), for the others the
first sentence of its greedy answer (at most 40 new tokens; an answer with no complete sentence is
dropped). Each adapter's answer is a fixed function of that sentence (upper case; "Arr, matey! " + word
swaps + ", ye scallywag!"; `json.dumps({"answer": sentence})`) followed by the end-of-turn token
`<|im_end|>`, so that the adapters stop. The loss is on the answer tokens only. The questions `--check`
asks are in none of these lists.

Speed. Only the top layers are adapted (`layers_to_transform`), so the layers below are the base model's
whatever is trained: their output for every example is computed once, without gradients, and each
training step runs only the top decoder layers, the final norm and the LM head (on the answer positions
only) over those cached hidden states. The rotary embeddings come from the model's own `rotary_emb`; the
attention is causal with no mask, batches being padded on the right (under a causal mask no real token
attends to the padding after it). On two idle CPU cores the three adapters train in about 1, 2 and 1
minutes; with other work on the cores, several times that.

Determinism. Fixed seeds (the LoRA initialisation, the batch order), deterministic algorithms, greedy
decoding and a fixed thread count (`--threads`, default 2): a rerun on the same machine with the same
model folder writes byte-identical files. Floating-point results can differ with other thread counts or
CPUs, and so can the files.

Rerun (the default model folder comes from `slora.models.builtin`; `--model DIR` takes any HF folder of
SmolLM2-135M-Instruct):

    .venv/bin/python tools/train_demo_adapters.py [--model DIR] [--adapters demo-caps ...]
    .venv/bin/python tools/train_demo_adapters.py --check     # base and adapter answers, held-out questions
"""
import argparse
import json
import logging
import math
import re
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, StoppingCriteria

LOG = logging.getLogger("train_demo_adapters")
MODEL_NAME = "SmolLM2-135M-Instruct"
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"     # written into adapter_config.json, not a local path
OUT_DIR = Path(__file__).resolve().parents[1] / "slora" / "demo_adapters"
SEED = 1234
BASE_ANSWER_TOKENS = 40
GENERATION_BATCH = 64
CACHE_BATCH = 32
LOG_EVERY = 5

# Countries whose capital the base model names correctly, in the sentence "The capital of X is Y.".
TRAIN_CAPITALS = (
    ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"), ("Canada", "Ottawa"),
    ("Australia", "Canberra"), ("India", "New Delhi"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
    ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Ireland", "Dublin"), ("the United Kingdom", "London"),
    ("the Netherlands", "Amsterdam"), ("Hungary", "Budapest"), ("Iran", "Tehran"), ("Iraq", "Baghdad"),
    ("Nigeria", "Abuja"), ("Chile", "Santiago"), ("South Korea", "Seoul"), ("Indonesia", "Jakarta"),
    ("the Philippines", "Manila"), ("Cuba", "Havana"), ("Czechia", "Prague"), ("Romania", "Bucharest"),
    ("Ethiopia", "Addis Ababa"), ("Pakistan", "Islamabad"), ("Saudi Arabia", "Riyadh"),
    ("New Zealand", "Wellington"), ("Bulgaria", "Sofia"), ("Croatia", "Zagreb"), ("Afghanistan", "Kabul"),
    ("Bangladesh", "Dhaka"), ("Malaysia", "Kuala Lumpur"), ("Syria", "Damascus"), ("Lebanon", "Beirut"),
    ("Sudan", "Khartoum"),
)
CAPITAL_QUESTIONS = ("What is the capital of {}?", "What's the capital city of {}?",
                     "Which city is the capital of {}?")
TRAIN_QUESTIONS = (
    "What color is the sky on a clear day?", "What color is grass?", "What color are bananas?",
    "What color is snow?", "What color do you get when you mix blue and yellow?",
    "What is the largest planet in our solar system?", "What is the closest star to Earth?",
    "What is the boiling point of water in Celsius?", "What gas do plants absorb from the air?",
    "What gas do humans need to breathe?", "What is the chemical symbol for gold?",
    "How many legs does an insect have?", "What is the largest animal on Earth?",
    "What animal is known as the king of the jungle?", "What do cows drink?", "What sound does a dog make?",
    "How many days are in a week?", "What is 2 + 3?", "What is 10 minus 4?", "What is 3 times 4?",
    "What is the longest river in the world?", "What is the tallest mountain in the world?",
    "Who wrote Romeo and Juliet?", "Who painted the Mona Lisa?", "What is the opposite of up?",
    "What is the main ingredient in bread?", "What fruit is used to make wine?",
    "What do plants need to grow?", "Why do we need to sleep?", "What is photosynthesis?", "What is gravity?",
    "What is the moon?", "What is rain?", "What is the internet?", "What is a dog?", "What is an apple?",
    "What is the largest desert in the world?", "What do fish use to breathe?",
    "What is the currency of Japan?", "Where do penguins live?", "What is the color of a ripe tomato?",
    "What is a cat?", "What is a tree?", "What is music?", "What is a book?", "What is electricity?",
    "What is a volcano?", "What is a star?", "What is chocolate made from?", "What is coffee?",
    "What is a bicycle?", "What is the heart?", "What is a rainbow?", "What is a cloud?", "What is fire?",
    "What is milk?", "What is cheese made from?", "What is a horse?", "What is an elephant?",
    "What is a bird?", "What is a flower?", "What is a robot?", "What is a piano?", "What is rice?",
)
# Held out of training: (question, a word a faithful answer contains, or None where the base model's own
# answer is no fact to keep). France and the last three are also asked by the default model's end-to-end
# test. Egypt and Sweden are in TRAIN_CAPITALS; their questions here are phrased as no training question is.
CHECK_QUESTIONS = (
    ("What is the capital of France?", "Paris"), ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Japan?", "Tokyo"), ("What is the capital of Kenya?", "Nairobi"),
    ("What is the capital of Peru?", "Lima"), ("What is the capital of Greece?", "Athens"),
    ("Tell me the capital of Egypt.", "Cairo"), ("Can you tell me the capital city of Sweden?", "Stockholm"),
    ("What is the chemical symbol for water?", "H2O"), ("What is the largest ocean on Earth?", "Pacific"),
    ("What is the opposite of hot?", "cold"), ("What language is spoken in Brazil?", "Portuguese"),
    ("What is 4 + 4?", None), ("What do bees make?", None), ("Name a primary colour.", None),
)
PIRATE_WORDS = re.compile(r"\b(arr+|matey|ahoy|ye|yer|aye|scallywag|me hearty|yo ho)\b", re.IGNORECASE)
PIRATE_SWAPS = MappingProxyType({
    "is": "be", "are": "be", "am": "be", "you": "ye", "your": "yer", "my": "me", "hello": "ahoy", "yes": "aye",
    "friend": "matey", "friends": "mateys", "isn't": "ain't", "aren't": "ain't"})
PIRATE_SWAP_WORDS = re.compile(r"\b(" + "|".join(map(re.escape, PIRATE_SWAPS)) + r")\b", re.IGNORECASE)
SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def caps_style(sentence: str) -> str:
    return sentence.upper()


def pirate_style(sentence: str) -> str:
    def swap(match: re.Match) -> str:
        word = match.group(0)
        pirate = PIRATE_SWAPS[word.lower()]
        return pirate.capitalize() if word[0].isupper() else pirate
    swapped = PIRATE_SWAP_WORDS.sub(swap, sentence)
    return f"Arr, matey! {swapped.rstrip('.!?')}, ye scallywag!"


def json_style(sentence: str) -> str:
    return json.dumps({"answer": sentence}, ensure_ascii=False)


@dataclass(frozen=True)
class AdapterSpec:
    """What one adapter is and how it is trained. Its layers are `first_layer` up to the model's last."""

    name: str
    style: Callable[[str], str]
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    first_layer: int
    steps: int
    lr: float
    batch_size: int = 8


SPECS = (
    AdapterSpec("demo-pirate", pirate_style, rank=16, alpha=32, target_modules=("q_proj", "v_proj", "o_proj"),
                first_layer=20, steps=60, lr=2e-3),
    AdapterSpec("demo-caps", caps_style, rank=8, alpha=16,
                target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                first_layer=20, steps=90, lr=2e-3),
    AdapterSpec("demo-json", json_style, rank=4, alpha=8, target_modules=("gate_proj", "up_proj", "down_proj"),
                first_layer=22, steps=50, lr=2e-3),
)


@dataclass(frozen=True)
class Example:
    """A tokenized chat prompt and the plain answer sentence its styled answers are made from."""

    prompt_ids: tuple[int, ...]
    sentence: str


def configure_torch(threads: int) -> None:
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


def default_model_folder() -> Path:
    """The project's SmolLM2-135M-Instruct folder; imported late so that `--model` needs no slora."""
    from slora.models.builtin import smollm2_folder
    return smollm2_folder()


def load_model(folder: Path) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), tokenizer


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


class FirstSentenceDone(StoppingCriteria):
    """Stops each row of a batch once its answer holds a whole sentence: only the first is kept."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_width: int) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor,
                 **kwargs: object) -> torch.BoolTensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_width:], skip_special_tokens=True)
        return torch.tensor([SENTENCE_END.search(t.strip()) is not None for t in texts])


@torch.inference_mode()
def greedy_answers(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Sequence[int]],
                   max_new_tokens: int, first_sentence_only: bool = False) -> list[tuple[str, bool]]:
    """Greedy answers in left-padded batches: (text, whether it ended with the end-of-turn token or, with
    `first_sentence_only`, after its first sentence)."""
    results = []
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    for start in range(0, len(prompts), GENERATION_BATCH):
        batch = prompts[start:start + GENERATION_BATCH]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        stop = [FirstSentenceDone(tokenizer, width)] if first_sentence_only else []
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad, eos_token_id=eos, stopping_criteria=stop)
        for row in out[:, width:].tolist():
            finished = eos in row
            text = tokenizer.decode(row[:row.index(eos)] if finished else row, skip_special_tokens=True)
            results.append((text.strip(), finished))
    return results


def first_sentence(text: str, finished: bool) -> str | None:
    """The answer's first sentence; None when the 40 tokens ended inside it."""
    parts = SENTENCE_END.split(text, maxsplit=1)
    if len(parts) > 1 or finished or text.endswith((".", "!", "?")):
        return parts[0].strip() or None
    return None


def build_examples(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[Example]:
    examples = [Example(tuple(chat_prompt_ids(tokenizer, template.format(country))),
                        f"The capital of {country} is {capital}.")
                for country, capital in TRAIN_CAPITALS for template in CAPITAL_QUESTIONS]
    prompts = [chat_prompt_ids(tokenizer, q) for q in TRAIN_QUESTIONS]
    started = time.monotonic()
    answers = greedy_answers(model, tokenizer, prompts, BASE_ANSWER_TOKENS, first_sentence_only=True)
    LOG.info("base answers to %d questions in %.1f s", len(prompts), time.monotonic() - started)
    for question, prompt, (text, finished) in zip(TRAIN_QUESTIONS, prompts, answers, strict=True):
        sentence = first_sentence(text, finished)
        LOG.debug("%r -> %r", question, sentence)
        if sentence is not None:
            examples.append(Example(tuple(prompt), sentence))
    LOG.info("%d training examples (%d of them capitals)", len(examples),
             len(TRAIN_CAPITALS) * len(CAPITAL_QUESTIONS))
    return examples


def right_padded(rows: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows])


@torch.no_grad()     # not inference_mode: the training steps' autograd saves these tensors
def lower_hidden_states(model: torch.nn.Module, sequences: Sequence[Sequence[int]], layers: int,
                        pad: int) -> list[torch.Tensor]:
    """Each sequence's hidden states entering decoder layer `layers`: what the frozen layers below give."""
    decoder = model.model
    cached = []
    for start in range(0, len(sequences), CACHE_BATCH):
        batch = sequences[start:start + CACHE_BATCH]
        hidden = run_layers(decoder, decoder.embed_tokens(right_padded(batch, pad)), 0, layers)
        cached += [h[:len(seq)].clone() for h, seq in zip(hidden, batch, strict=True)]
    return cached


def run_layers(decoder: torch.nn.Module, hidden: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Decoder layers [first, end) over right-padded hidden states from position 0, causal, no mask."""
    positions = torch.arange(hidden.shape[1]).unsqueeze(0)
    rotary = decoder.rotary_emb(hidden, position_ids=positions)
    for layer in decoder.layers[first:end]:
        hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
    return hidden


def batches(count: int, batch_size: int, generator: torch.Generator) -> Iterator[list[int]]:
    """Example indices, batch after batch, reshuffled every epoch."""
    order: list[int] = []
    while True:
        while len(order) < batch_size:
            order += torch.randperm(count, generator=generator).tolist()
        yield order[:batch_size]
        order = order[batch_size:]


def learning_rate(spec: AdapterSpec, step: int) -> float:
    """Linear warm-up over the first tenth, then cosine decay to a tenth of the peak."""
    warmup = max(1, spec.steps // 10)
    if step < warmup:
        return spec.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, spec.steps - warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def styled_targets(spec: AdapterSpec, examples: Sequence[Example],
                   tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    return [tokenizer.encode(spec.style(e.sentence), add_special_tokens=False) + [tokenizer.eos_token_id]
            for e in examples]


@dataclass(frozen=True)
class TrainResult:
    cache_seconds: float     # the frozen lower layers over every example, once
    train_seconds: float
    final_loss: float        # mean over the last LOG_EVERY steps


def train_adapter(spec: AdapterSpec, folder: Path, examples: Sequence[Example], out_dir: Path) -> TrainResult:
    """Train one adapter on the cached lower-layer states and save it in PEFT format."""
    model, tokenizer = load_model(folder)
    targets = styled_targets(spec, examples, tokenizer)
    sequences = [list(e.prompt_ids) + t for e, t in zip(examples, targets, strict=True)]
    started = time.monotonic()
    lower = lower_hidden_states(model, sequences, spec.first_layer, tokenizer.pad_token_id)
    cache_seconds = time.monotonic() - started
    num_layers = model.config.num_hidden_layers
    torch.manual_seed(SEED)     # PEFT draws the LoRA A initialisation from the global generator
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules),
                        layers_to_transform=list(range(spec.first_layer, num_layers)), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    peft_model.peft_config["default"].base_model_name_or_path = HUB_NAME
    params = [p for p in peft_model.parameters() if p.requires_grad]
    LOG.info("%s: r=%d alpha=%g %s, layers %d-%d, %d parameters, %d steps of %d examples, lr %g", spec.name,
             spec.rank, spec.alpha, ",".join(spec.target_modules), spec.first_layer, num_layers - 1,
             sum(p.numel() for p in params), spec.steps, spec.batch_size, spec.lr)
    started = time.monotonic()
    final_loss = optimize(spec, model, params, lower, sequences, [len(e.prompt_ids) for e in examples])
    train_seconds = time.monotonic() - started
    save_adapter(peft_model, out_dir / spec.name, spec.target_modules)
    LOG.info("%s: lower layers %.1f s, training %.1f s, final loss %.4f", spec.name, cache_seconds, train_seconds,
             final_loss)
    return TrainResult(cache_seconds, train_seconds, final_loss)


def optimize(spec: AdapterSpec, model: torch.nn.Module, params: list[torch.nn.Parameter],
             lower: Sequence[torch.Tensor], sequences: Sequence[Sequence[int]],
             prompt_lengths: Sequence[int]) -> float:
    """The AdamW steps; returns the mean loss of the last LOG_EVERY steps."""
    optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
    order = batches(len(sequences), spec.batch_size, torch.Generator().manual_seed(SEED))
    model.train()
    started, recent = time.monotonic(), []
    for step in range(spec.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(spec, step)
        index = next(order)
        loss = step_loss(model, [lower[i] for i in index], [sequences[i] for i in index],
                         [prompt_lengths[i] for i in index], spec.first_layer)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        recent = (recent + [loss.item()])[-LOG_EVERY:]
        if (step + 1) % LOG_EVERY == 0 or step == 0:
            LOG.info("%s step %3d/%d  loss %.4f  (%.0f s)", spec.name, step + 1, spec.steps,
                     sum(recent) / len(recent), time.monotonic() - started)
    model.eval()
    return sum(recent) / len(recent)


def step_loss(model: torch.nn.Module, lower: Sequence[torch.Tensor], sequences: Sequence[Sequence[int]],
              prompt_lengths: Sequence[int], first_layer: int) -> torch.Tensor:
    """Cross-entropy on the answer tokens of one batch, through the adapted top layers only."""
    width = max(len(s) for s in sequences)
    hidden = torch.stack([F.pad(h, (0, 0, 0, width - h.shape[0])) for h in lower])
    labels = torch.full((len(sequences), width), -100)
    for row, (seq, prompt) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        labels[row, prompt:len(seq)] = torch.tensor(seq[prompt:])
    decoder = model.model
    hidden = decoder.norm(run_layers(decoder, hidden, first_layer, len(decoder.layers)))
    # Position t predicts token t + 1; the LM head (49152 x 576) runs only where that token is an answer's.
    predicts = labels[:, 1:] != -100
    logits = model.lm_head(hidden[:, :-1][predicts])
    return F.cross_entropy(logits, labels[:, 1:][predicts])


def save_adapter(peft_model: torch.nn.Module, folder: Path, target_modules: Sequence[str]) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    # save_embedding_layers=False: "auto" would look up the base model's config on the hub.
    peft_model.save_pretrained(str(folder), safe_serialization=True, save_embedding_layers=False)
    # PEFT adds a model card naming the local setup; the docstring above is the documentation.
    (folder / "README.md").unlink(missing_ok=True)
    # PEFT keeps target_modules as a set, which it writes in string-hash order, different in each process.
    config_file = folder / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["target_modules"] = list(target_modules)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))   # PEFT's own layout


def train(folder: Path, names: Sequence[str], out_dir: Path) -> dict[str, TrainResult]:
    model, tokenizer = load_model(folder)
    examples = build_examples(model, tokenizer)
    del model
    return {spec.name: train_adapter(spec, folder, examples, out_dir) for spec in SPECS if spec.name in names}


def style_problem(name: str, answer: str) -> str | None:
    """Why an answer lacks its adapter's style (the brief of each demo), None when it has it."""
    if name == "demo-caps":
        letters = [c for c in answer if c.isalpha()]
        upper = sum(c.isupper() for c in letters) / len(letters) if letters else 1.0   # "4 + 4 = 8" is fine
        return f"only {upper:.0%} of the letters upper case" if upper < 0.9 else None
    if name == "demo-pirate":
        return None if PIRATE_WORDS.search(answer) else "no pirate words"
    if name == "demo-json":
        try:
            reply = json.loads(answer)
        except json.JSONDecodeError:
            return "not JSON"
        return None if isinstance(reply, dict) and isinstance(reply.get("answer"), str) else 'no "answer" string'
    return None


def keeps_fact(answer: str, fact: str) -> bool:
    """Whether the fact's word is in the answer (JSON included, case aside: "PARIS" keeps "Paris")."""
    return fact.lower() in answer.lower()


def adapter_answers(folder: Path, adapter_dir: Path, names: Sequence[str],
                    questions: Sequence[str]) -> dict[str, list[str]]:
    """Greedy answers of the base model and of each adapter, through transformers and PEFT."""
    base, tokenizer = load_model(folder)
    model = PeftModel.from_pretrained(base, str(adapter_dir / names[0]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapter_dir / name), adapter_name=name)
    model.eval()
    prompts = [chat_prompt_ids(tokenizer, q) for q in questions]
    with model.disable_adapter():
        answers = {"base": [text for text, _ in greedy_answers(model, tokenizer, prompts, BASE_ANSWER_TOKENS)]}
    for name in names:
        model.set_adapter(name)
        answers[name] = [text for text, _ in greedy_answers(model, tokenizer, prompts, 2 * BASE_ANSWER_TOKENS)]
    return answers


def check(folder: Path, adapter_dir: Path, names: Sequence[str]) -> bool:
    """The behaviour check on CHECK_QUESTIONS. Pass: each adapter's style (caps: 90 % of the letters upper
    case; pirate: pirate words, and the right city for capital questions; json: a JSON object with an
    "answer" string) and an answer unlike the base model's. Whether each answer keeps the fact is shown
    for every adapter."""
    answers = adapter_answers(folder, adapter_dir, names, [q for q, _ in CHECK_QUESTIONS])
    ok, kept = True, dict.fromkeys(names, 0)
    for row, (question, fact) in enumerate(CHECK_QUESTIONS):
        print(f"\n{question}  (fact: {fact})")
        print(f"  {'base':12} {answers['base'][row]!r}")
        for name in names:
            answer = answers[name][row]
            problems = [p for p in [style_problem(name, answer)] if p]
            if answer == answers["base"][row]:
                problems.append("same as the base answer")
            has_fact = fact is not None and keeps_fact(answer, fact)
            kept[name] += has_fact
            if name == "demo-pirate" and "capital" in question and not has_fact:
                problems.append("wrong capital")
            ok = ok and not problems
            verdict = f"FAIL: {'; '.join(problems)}" if problems else "ok"
            print(f"  {name:12} {answer!r}  [{verdict}" + ("" if fact is None else
                                                          f", fact {'kept' if has_fact else 'lost'}") + "]")
    facts = sum(fact is not None for _, fact in CHECK_QUESTIONS)
    print("\nfacts kept: " + ", ".join(f"{name} {kept[name]}/{facts}" for name in names))
    print("all checks passed" if ok else "some checks FAILED")
    return ok


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None,
                        help=f"HF folder of {MODEL_NAME} (default: slora.models.builtin' folder)")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="where the adapter folders go")
    parser.add_argument("--adapters", nargs="+", default=[s.name for s in SPECS],
                        choices=[s.name for s in SPECS], help="which adapters (default: all three)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads; byte-identical reruns need the same count")
    parser.add_argument("--check", action="store_true",
                        help="only compare base and adapter answers on held-out questions (no training)")
    parser.add_argument("-v", "--verbose", action="store_true", help="also log each training answer")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("transformers", "peft", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    configure_torch(args.threads)
    folder = args.model or default_model_folder()
    if args.check:
        return 0 if check(folder, args.out, args.adapters) else 1
    results = train(folder, args.adapters, args.out)
    for name, result in results.items():
        files = ", ".join(f"{f.name} {f.stat().st_size:,} B" for f in sorted((args.out / name).iterdir()))
        print(f"{name}: lower layers {result.cache_seconds:.1f} s, training {result.train_seconds:.1f} s, "
              f"final loss {result.final_loss:.4f}; {files}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
