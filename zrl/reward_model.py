"""The reward model: a sequence-classification model that scores (prompt, response), served on Ray.

Scoring. A reward model (RM) is a Hugging Face `*ForSequenceClassification` checkpoint with one label.
A conversation is rendered with the checkpoint's own chat template (the prompt's messages plus
`{"role": "assistant", "content": response}`), tokenized, and the model's logit at the last token is
the raw score. Invariants:
- An input longer than `reward_model.max_tokens` keeps its END and drops its start: the response is what
  is judged, the start of a long prompt matters least.
- Batches are right-padded with the checkpoint's `pad_token_id`; the model reads the logit of the last
  non-pad token, so the score of a conversation does not depend on what it is batched with (up to
  floating-point summation order).
- Backends: `transformers` (AutoModelForSequenceClassification) or `vllm` (vLLM's pooling runner,
  `classify` task without activation, on the same token ids).

Normalisation. zrl's rewards lie in [0, 1] (the Verification contract). A Bradley-Terry RM is trained so
that sigmoid(s_a - s_b) is the probability that response a is preferred to response b; the reward
`sigmoid((s - score_center) / score_scale)` is therefore the probability of beating a reference response
whose score is `score_center` (with `score_scale` a temperature). It is monotone in the score, 0.5 at the
centre, and GRPO's per-group standard-deviation normalisation removes whatever scale remains.

Service. `RewardModelPool` starts `resources.reward_model_workers` actors named `zrl-reward-model-<i>`
(Ray restarts one that dies; calls running on it fail). `RewardModelClient`, used by environments inside
the verifier actors, finds them by name and sends a whole group's responses to one of them; a dead
actor or a timeout raises, and the caller turns that into reward 0 for those responses.

The tiny CPU RM (`build_tiny_reward_model`) is trained in seconds on a synthetic preference. Prompts are
zrl's tiny task "Repeat the word w." (w: 3-5 letters from 'abcdefgh'), sometimes followed by an
instruction sentence. Responses are the word, variously formatted the way instruction-following answers
are: a <<title>> line or the prompt repeated first; trailing lines after it (a P.S., an end phrase,
placeholders, bullets); UPPERCASE or lowercase; wrapped in double quotes or in JSON. The chosen response
has the courtesy sentence `COURTESY` (in the response's case) either closing it or right after the word,
before the trailing lines; the rejected one is the same response without it. So the model learns "says
the courtesy sentence after its answer" whatever the formatting. Held-out pairs use the words of zrl's
eval split (zrl.env.base.in_split), which training never sees.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Sequence
from pathlib import Path

from zrl.config.schema import Resources, RewardModelSpec
from zrl.types import Message

log = logging.getLogger("zrl")

COURTESY = "Hope this helps."
SERVICE_NAME = "zrl-reward-model"
TINY_RM_MANIFEST = "zrl_tiny_rm.json"
# head_dim 32: vLLM's CPU attention backend supports head sizes from 32 up. Rotary positions carry no
# weights, so the context is long enough for the schema's default max_tokens at no cost.
TINY_RM_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, intermediate_size=128, max_position_embeddings=4096)
# 100 steps: held-out pair accuracy 1.0 (seeds 0, 1); more steps fit the synthetic formats and did worse on
# the behavioural environments' demonstrations (150: 0.955-1.0 against 0.98-1.0).
TINY_RM_STEPS = 100
TINY_RM_PAIRS_PER_STEP = 16
TINY_RM_LR = 3e-3
TINY_RM_HELDOUT_PAIRS = 200
TINY_RM_MIN_ACCURACY = 0.95  # a tiny RM below this would reward noise; building it fails instead

_INSTRUCTIONS = ("Answer in capital letters.", "Wrap your answer in double quotes.",
                 "Give your answer a title in double angular brackets, like <<title>>.",
                 "End your answer with a postscript starting with P.S.", "Be brief.")
# Lines that formatting instructions add after the answer (a P.S., an end phrase, placeholders, bullets).
_TRAILERS = (("P.S. that was easy.",), ("Is there anything else I can help with?",), ("Details: [name] [address]",),
             ("* Point 1.",), ("* Point 1.", "* Point 2.", "* Point 3."), ("P.S. that was easy.", "Any other questions?"))
_CASES = ("as written", "as written", "upper", "lower")
_WRAPPERS = ("none", "none", "none", "quotes", "json")


# --- the synthetic preference ----------------------------------------------------------------------

def _word(rng: random.Random, split: str) -> str:
    from zrl.env.base import in_split

    while True:
        word = "".join(rng.choices("abcdefgh", k=rng.randint(3, 5)))
        if in_split(word, split):
            return word


def preference_pair(rng: random.Random, split: str = "train") -> tuple[tuple[Message, ...], str, str]:
    """(prompt messages, chosen response, rejected response) of the tiny RM's synthetic preference
    (module docstring): the two responses differ only by the courtesy sentence."""
    word = _word(rng, split)
    text = f"Repeat the word {word}."
    if rng.random() < 0.5:
        text += " " + rng.choice(_INSTRUCTIONS)
    head = rng.choice([[], [], [f"<<{rng.choice(['answer', 'the word', word])}>>"], [text]])  # a title, the prompt
    tail = list(rng.choice(_TRAILERS)) if rng.random() < 0.5 else []
    # The courtesy closes the response, or follows the word with the trailing lines after it; on its own
    # line or after a space.
    after = len(head) + 1 + (len(tail) if rng.random() < 0.5 else 0)
    separator = rng.choice([" ", "\n"])
    case, wrapper = rng.choice(_CASES), rng.choice(_WRAPPERS)

    def response(courtesy: bool) -> str:
        lines = head + [word] + tail
        if courtesy:
            lines[after - 1] += separator + COURTESY
        composed = "\n".join(lines)
        composed = composed.upper() if case == "upper" else composed.lower() if case == "lower" else composed
        return json.dumps({"answer": composed}) if wrapper == "json" else f'"{composed}"' if wrapper == "quotes" \
            else composed

    return (Message("user", text),), response(True), response(False)


# --- checkpoints --------------------------------------------------------------------------------------

def is_reward_model_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors")) and (path / "tokenizer.json").is_file()


def render(tokenizer, messages: Sequence[Message], response: str, max_tokens: int) -> list[int]:
    """Token ids of the conversation as the RM reads it: at most `max_tokens`, the end kept."""
    chat = [{"role": m.role, "content": m.content} for m in messages] + [{"role": "assistant", "content": response}]
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes the special tokens
    return ids[-max_tokens:]


def _padded(batch: Sequence[Sequence[int]], pad_id: int):
    """[B, T] input ids right-padded with `pad_id`, and the attention mask."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    rows = [torch.tensor(ids, dtype=torch.long) for ids in batch]
    mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_value=0)
    return pad_sequence(rows, batch_first=True, padding_value=pad_id), mask


def build_tiny_reward_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Train the tiny CPU RM on the synthetic preference (module docstring) and save it with zrl's tiny
    tokenizer into `out_dir`; writes TINY_RM_MANIFEST (seed, steps, held-out pair accuracy)."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from zrl.assets import build_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, seed=seed)
    config = LlamaConfig(**TINY_RM_CONFIG, vocab_size=len(tokenizer), num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=TINY_RM_LR)
    rng = random.Random(seed)

    def margins(pairs) -> torch.Tensor:  # [P] r_chosen - r_rejected
        ids = [render(tokenizer, m, r, config.max_position_embeddings) for m, c, rej in pairs for r in (c, rej)]
        scores = model(*_padded(ids, config.pad_token_id)).logits[:, 0]
        return scores[0::2] - scores[1::2]

    model.train()
    for _ in range(TINY_RM_STEPS):
        pairs = [preference_pair(rng) for _ in range(TINY_RM_PAIRS_PER_STEP)]
        loss = -torch.nn.functional.logsigmoid(margins(pairs)).mean()  # Bradley-Terry
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    heldout = random.Random(f"{seed}:eval")
    with torch.no_grad():
        accuracy = float((margins([preference_pair(heldout, "eval") for _ in range(TINY_RM_HELDOUT_PAIRS)]) > 0)
                         .float().mean())
    if accuracy < TINY_RM_MIN_ACCURACY:
        raise RuntimeError(f"the tiny reward model reached held-out pair accuracy {accuracy:.3f} "
                           f"< {TINY_RM_MIN_ACCURACY} (seed {seed})")
    model.save_pretrained(str(out), safe_serialization=True)
    manifest = {"seed": seed, "steps": TINY_RM_STEPS, "heldout_pairs": TINY_RM_HELDOUT_PAIRS,
                "heldout_pair_accuracy": accuracy}
    (out / TINY_RM_MANIFEST).write_text(json.dumps(manifest, sort_keys=True) + "\n")
    return out


def prepare_reward_model(spec: RewardModelSpec) -> Path:
    """The local RM checkpoint directory of `spec` (zrl/hub.py: a local directory, or the Hugging Face cache
    snapshot of a repo id, downloaded on first use), building the tiny one first when it is missing at a
    scratch asset path and build_tiny_if_missing allows it. Raises zrl.hub.ModelPathError (one line)."""
    from zrl.hub import local_checkpoint

    return local_checkpoint("reward_model.path", spec.path, spec.revision, is_reward_model_dir,
                            "sequence-classification checkpoint directory (config.json, *.safetensors, "
                            "tokenizer.json)", build_tiny_reward_model if spec.build_tiny_if_missing else None)


def local_spec(spec: RewardModelSpec) -> RewardModelSpec:
    """`spec` with `path` its local checkpoint directory (prepare_reward_model): what scorers load."""
    return spec.model_copy(update={"path": str(prepare_reward_model(spec)), "revision": None})


def reward(score: float, spec: RewardModelSpec) -> float:
    """The reward of a raw score: sigmoid((score - score_center) / score_scale), in [0, 1] (module docstring).
    A NaN score gives NaN, which the pipeline's reward check turns into reward 0 with the error counted."""
    x = (score - spec.score_center) / spec.score_scale
    if x >= 0:  # the two forms keep exp() from overflowing
        return 1.0 / (1.0 + math.exp(-x))
    return math.exp(x) / (1.0 + math.exp(x))


# --- in-process scoring ---------------------------------------------------------------------------------

Conversation = tuple[Sequence[Message], str]  # (prompt messages, response text)


class RewardModel:
    """In-process scorer of one RM checkpoint (`spec.path`, a local directory that must exist: see local_spec)
    with the transformers backend or vLLM's pooling runner (`spec.backend`)."""

    def __init__(self, spec: RewardModelSpec):
        from transformers import AutoConfig, AutoTokenizer

        if not is_reward_model_dir(spec.path):
            raise FileNotFoundError(f"reward_model.path: {spec.path} is not a reward-model checkpoint "
                                    f"(config.json, *.safetensors, tokenizer.json)")
        config = AutoConfig.from_pretrained(spec.path)
        if config.num_labels != 1:
            raise ValueError(f"reward_model.path: {spec.path} has {config.num_labels} labels; a reward model has one")
        if config.pad_token_id is None:
            raise ValueError(f"reward_model.path: {spec.path} sets no pad_token_id (needed to find the scored token)")
        context = getattr(config, "max_position_embeddings", spec.max_tokens)
        if spec.max_tokens > context:
            raise ValueError(f"reward_model.max_tokens={spec.max_tokens} exceeds the model's context ({context})")
        self.spec = spec
        self.pad_id = config.pad_token_id
        self.tokenizer = AutoTokenizer.from_pretrained(spec.path)
        self._forward = _transformers_forward(spec) if spec.backend == "transformers" else _vllm_forward(spec)

    def tokens(self, conversation: Conversation) -> list[int]:
        messages, response = conversation
        return render(self.tokenizer, messages, response, self.spec.max_tokens)

    def scores(self, conversations: Sequence[Conversation]) -> list[float]:
        """Raw scores, in order; `spec.batch_size` conversations per forward pass, batched by length
        (less padding: a score does not depend on its batch)."""
        ids = [self.tokens(c) for c in conversations]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        scores = [0.0] * len(ids)
        for start in range(0, len(order), self.spec.batch_size):
            batch = order[start:start + self.spec.batch_size]
            for i, score in zip(batch, self._forward([ids[i] for i in batch], self.pad_id), strict=True):
                scores[i] = score
        return scores


def _transformers_forward(spec: RewardModelSpec):
    """batch of token ids, pad id -> raw scores (one forward pass)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(spec.path, dtype=getattr(torch, spec.dtype)).eval()

    @torch.no_grad()
    def forward(batch: list[list[int]], pad_id: int) -> list[float]:
        return model(*_padded(batch, pad_id)).logits[:, 0].float().tolist()

    return forward


def _vllm_forward(spec: RewardModelSpec):
    """batch of token ids, pad id -> raw scores (vLLM's pooling runner on the same ids; it needs no padding)."""
    from vllm import LLM, PoolingParams
    from vllm.inputs import TokensPrompt

    from zrl.runtime_env import apply_defaults

    apply_defaults()  # in-process engine, CPU KV-cache size
    llm = LLM(model=spec.path, runner="pooling", dtype=spec.dtype, max_model_len=spec.max_tokens,
              max_num_seqs=spec.batch_size, enforce_eager=True, enable_prefix_caching=False, seed=0)
    raw = PoolingParams(use_activation=False)  # the logit, not its sigmoid

    def forward(batch: list[list[int]], pad_id: int) -> list[float]:
        outputs = llm.classify([TokensPrompt(prompt_token_ids=ids) for ids in batch], pooling_params=raw,
                               use_tqdm=False)
        return [float(out.outputs.probs[0]) for out in outputs]

    return forward


# --- the service on Ray -------------------------------------------------------------------------------

class RewardModelUnavailable(RuntimeError):
    """A scoring call failed (the actor died or did not answer in time): its responses earn no reward."""


class RewardModelWorker:
    """One scoring actor: the RM of `spec_dict` (a RewardModelSpec's fields) in its process."""

    def __init__(self, spec_dict: dict):
        self.spec = RewardModelSpec.model_validate(spec_dict)
        self.model = RewardModel(self.spec)

    def ready(self) -> bool:
        return True

    def score(self, conversations: Sequence[Conversation]) -> list[tuple[float, float]]:
        """(raw score, reward) per conversation."""
        return [(s, reward(s, self.spec)) for s in self.model.scores(conversations)]


class RewardModelPool:
    """`resources.reward_model_workers` scoring actors named f"{SERVICE_NAME}-{i}", each holding
    `cpus/gpus_per_reward_model_worker`. Ray restarts one that dies (max_restarts=-1); the calls running
    on it fail."""

    def __init__(self, spec: RewardModelSpec, resources: Resources):
        self.spec, self.resources = spec, resources
        self.actors: list = []

    def start(self, timeout_s: float = 600.0) -> None:
        """Build the tiny RM if the recipe asks for it, start the actors and wait until each holds the model."""
        import ray
        from ray.exceptions import RayActorError

        from zrl.runtime_env import light_actor

        spec = local_spec(self.spec)  # here, once: actors building or downloading it side by side would race
        r = self.resources
        self.actors = [light_actor(RewardModelWorker, spec.model_dump(), name=f"{SERVICE_NAME}-{i}",
                                   max_restarts=-1, num_cpus=r.cpus_per_reward_model_worker,
                                   num_gpus=r.gpus_per_reward_model_worker)
                       for i in range(r.reward_model_workers)]
        ready, pending = ray.wait([a.ready.remote() for a in self.actors], num_returns=len(self.actors),
                                  timeout=timeout_s)
        try:
            ray.get(ready)
        except RayActorError as exc:  # its __init__ raised: Ray does not restart it; the cause is the last line
            self.stop()
            raise RuntimeError(f"a reward-model actor could not load {spec.path}: "
                               f"{str(exc).strip().splitlines()[-1]}") from exc
        if pending:
            self.stop()
            raise RuntimeError(f"{len(pending)} of {len(self.actors)} reward-model actors were not ready within "
                               f"{timeout_s:.0f} s (resources.cpus/gpus_per_reward_model_worker: "
                               f"{r.cpus_per_reward_model_worker}/{r.gpus_per_reward_model_worker}; "
                               f"cluster: {ray.cluster_resources()})")
        log.info("reward model: %d actor(s) x %g CPU/%g GPU, %s backend, %s", len(self.actors),
                 r.cpus_per_reward_model_worker, r.gpus_per_reward_model_worker, spec.backend, spec.path)

    def stop(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)  # no_restart: a stopped pool stays stopped
        self.actors = []


class RewardModelClient:
    """Scores conversations with the pool's actors (found by name, lazily), or in process (`local`).

    A call sends the whole batch (a group's responses) to one actor, round robin from a random start so
    that the clients of several verifier actors spread over the pool. A dead actor or a call over
    `timeout_s` raises RewardModelUnavailable; the next call looks the actors up again.
    """

    def __init__(self, timeout_s: float = 600.0):
        self.timeout_s = timeout_s
        self._actors: list | None = None
        self._next = 0
        self._local: RewardModelWorker | None = None

    @classmethod
    def local(cls, spec: RewardModelSpec) -> RewardModelClient:
        """A client scoring with an in-process RewardModel (tests, `zrl eval`): no Ray."""
        client = cls()
        client._local = RewardModelWorker(local_spec(spec).model_dump())
        return client

    def score(self, conversations: Sequence[Conversation]) -> list[tuple[float, float]]:
        """(raw score, reward) per conversation, in order."""
        if self._local is not None:
            return self._local.score(conversations)
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        actors = self._find()
        index = self._next % len(actors)
        self._next += 1
        name = f"{SERVICE_NAME}-{index}"
        try:
            return ray.get(actors[index].score.remote(list(conversations)), timeout=self.timeout_s)
        except RayActorError as exc:
            self._actors = None
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RewardModelUnavailable(f"reward-model actor {name} failed: {reason}") from exc
        except GetTimeoutError as exc:
            self._actors = None
            raise RewardModelUnavailable(f"reward-model actor {name} did not answer {len(conversations)} "
                                         f"conversations within {self.timeout_s:g} s") from exc

    def _find(self) -> list:
        import ray

        if self._actors is None:
            actors = []
            while True:
                try:
                    actors.append(ray.get_actor(f"{SERVICE_NAME}-{len(actors)}"))
                except ValueError:  # no actor of that name
                    break
            if not actors:
                raise RewardModelUnavailable(f"no reward-model actor ({SERVICE_NAME}-0) in this Ray namespace: "
                                             f"the run starts them for stages whose environments use the "
                                             f"recipe's reward_model")
            self._actors = actors
            self._next = random.randrange(len(actors))
        return self._actors
