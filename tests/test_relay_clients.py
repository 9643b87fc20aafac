"""Third-party clients against a real relay over a real two-node swarm of SmolLM2 on loopback:
the official ``openai`` client (``n``, penalties, ``logit_bias``, logprobs, ``echo`` with
prompt logprobs, ``x-request-id``, the served context), lm-evaluation-harness's
``local-completions`` with its remote tokenizer (a loglikelihood and a generate_until task
from a dataset shipped in tests/data/lm_eval, no hub), and litellm's ``openai/`` route.

One swarm and relay are shared by the module. lm-eval and litellm run in subprocesses, offline
(their own warnings are theirs, not this suite's), each with a time limit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import trio

from agent.demo.swarm_demo import node_memory_bytes, wait_for_coverage
from agent.harness.local_swarm import LocalSwarm, LocalSwarmConfig
from agent.io.client import open_swarm_client
from agent.models import model_path

pytestmark = [pytest.mark.swarm, pytest.mark.slow]

ALIAS = "smollm2"
NODES = 2
SETUP_TIMEOUT_S = 240.0
WORKER_CONTEXT = 2048  # the workers' positions per sequence (their default), not the GGUF's 8192
LM_EVAL_TASKS = Path(__file__).parent / "data" / "lm_eval"
CHAT = [{"role": "user", "content": "Name three colours."}]


@dataclasses.dataclass
class Relay:
    swarm: LocalSwarm
    url: str
    key: str
    client: openai.OpenAI


async def _start(swarm: LocalSwarm) -> None:
    await swarm.start_tracker()
    async with open_swarm_client(swarm.tracker_addr) as c:
        (entry,) = [m for m in await c.list_models() if m.alias == ALIAS]
        memory = node_memory_bytes(entry.n_layer, entry.bytes_per_block, NODES)
        for i in range(NODES):
            swarm.start_node(f"node-{i + 1}", memory)
        await wait_for_coverage(c, swarm, ALIAS, timeout_s=SETUP_TIMEOUT_S)
    await swarm.start_relay()


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    config = LocalSwarmConfig(model_path=model_path("smollm2"), model_alias=ALIAS)
    swarm = LocalSwarm(config, tmp_path_factory.mktemp("clients"))
    try:
        trio.run(_start, swarm)
        key = swarm.add_relay_key("clients")
        with openai.OpenAI(base_url=f"{swarm.relay_url}/v1", api_key=key, max_retries=0, timeout=120.0) as client:
            yield Relay(swarm, swarm.relay_url, key, client)
    finally:
        swarm.close_nowait()


@pytest.mark.timeout(300)
def test_openai_n_penalties_logit_bias_and_logprobs(relay: Relay) -> None:
    client = relay.client
    plain = client.chat.completions.with_raw_response.create(
        model=ALIAS, messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    assert plain.headers["x-request-id"].startswith("req_")
    greedy = plain.parse()
    assert greedy._request_id == plain.headers["x-request-id"]
    first = greedy.choices[0].logprobs.content[0]
    assert len(first.top_logprobs) == 3 and first.top_logprobs[0].logprob == first.logprob  # greedy: the argmax

    # n=2 at temperature 0: two sessions, the same greedy tokens
    two = client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=12, temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content == two.choices[1].message.content == greedy.choices[0].message.content
    # seeded sampling: choice j draws with seed + j, so choice 1 of seed 7 is choice 0 of seed 8
    sampled = client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=12, temperature=1.0, n=2, seed=7)
    alone = client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=12, temperature=1.0, seed=8)
    assert sampled.choices[1].message.content == alone.choices[0].message.content

    # logit_bias -100 on the greedy first token: never chosen; penalties make a repetitive prompt go elsewhere
    banned = client.chat.completions.create(
        model=ALIAS, messages=CHAT, max_tokens=12, temperature=0, logprobs=True,
        logit_bias={str(_token_id(relay, first.token)): -100},
    )  # fmt: skip
    assert banned.choices[0].logprobs.content[0].token != first.token
    repeat = "the the the the the the the the"
    free = client.completions.create(model=ALIAS, prompt=repeat, max_tokens=8, temperature=0)
    penalised = client.completions.create(
        model=ALIAS, prompt=repeat, max_tokens=8, temperature=0, frequency_penalty=2.0, presence_penalty=2.0,
        extra_body={"repeat_penalty": 1.5},
    )  # fmt: skip
    assert free.choices[0].text.count(" the") > penalised.choices[0].text.count(" the")


def _token_id(relay: Relay, text: str) -> int:
    import httpx

    reply = httpx.post(
        f"{relay.url}/tokenize", json={"model": ALIAS, "prompt": text, "add_special_tokens": False},
        headers={"Authorization": f"Bearer {relay.key}"}, timeout=30,
    )  # fmt: skip
    (token,) = reply.json()["tokens"]
    return int(token)


@pytest.mark.timeout(300)
def test_openai_completions_echo_with_prompt_logprobs_and_the_served_context(relay: Relay) -> None:
    client = relay.client
    prompt = "The capital of France is"
    echoed = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2)
    choice = echoed.choices[0]
    logprobs = choice.logprobs
    n_prompt = echoed.usage.prompt_tokens
    assert choice.text.startswith(prompt) and len(logprobs.tokens) == n_prompt + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])
    # the generated token's logprob is the one a request without echo reports
    alone = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=1, temperature=0, logprobs=2)
    assert logprobs.token_logprobs[-1] == pytest.approx(alone.choices[0].logprobs.token_logprobs[0], abs=1e-3)
    # the swarm scores the prompt one row a step; one unsplit worker scores it in one batch: the
    # two may differ by llama.cpp's batch-size rounding (measured: equal to 1e-6 relative here)
    unsplit = _unsplit_prompt_logprobs(relay, _tokens(relay, prompt))
    assert logprobs.token_logprobs[1:n_prompt] == pytest.approx(unsplit, abs=PROMPT_LOGPROB_BOUND)
    scored = client.completions.create(model=ALIAS, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(logprobs.token_logprobs[1:n_prompt], abs=1e-3)

    (card,) = [m for m in client.models.list().data if m.id == ALIAS]
    assert (card.model_extra or {})["context_length"] == WORKER_CONTEXT
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": "word " * 3000}], max_tokens=4
        )
    assert caught.value.code == "context_length_exceeded"


PROMPT_LOGPROB_BOUND = 1e-4


def _tokens(relay: Relay, text: str) -> list[int]:
    import httpx

    reply = httpx.post(
        f"{relay.url}/tokenize", json={"model": ALIAS, "prompt": text},
        headers={"Authorization": f"Bearer {relay.key}"}, timeout=30,
    )  # fmt: skip
    return [int(t) for t in reply.json()["tokens"]]


def _unsplit_prompt_logprobs(relay: Relay, tokens: list[int]) -> list[float]:
    """Each prompt token's logprob after the ones before it, from one unsplit worker's batch."""
    import numpy as np

    from agent.core.wire.worker_records import SeqInput
    from agent.io.worker.process import open_worker
    from agent.models import sha256_file

    async def run() -> list[float]:
        path = relay.swarm.config.model_path
        async with open_worker(path, 0, None, threads=1, max_sequences=1, model_sha256=sha256_file(path)) as single:
            entry = SeqInput(0, range(len(tokens)), token_ids=tokens, logit_rows=range(len(tokens) - 1))
            (out,) = await single.client.forward([entry])
        rows = np.asarray(out.logits, dtype=np.float64)
        peak = rows.max(axis=1, keepdims=True)
        log_sum = peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=1))
        return [float(rows[i, tokens[i + 1]] - log_sum[i]) for i in range(len(tokens) - 1)]

    return trio.run(run)


def _offline_env(relay: Relay) -> dict[str, str]:
    return {
        **os.environ, "OPENAI_API_KEY": relay.key, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONWARNINGS": "ignore",
    }  # fmt: skip


@pytest.mark.timeout(600)
def test_lm_eval_local_completions_runs_a_loglikelihood_and_a_generate_until_task(relay: Relay, tmp_path: Path) -> None:
    model_args = (
        f"model={ALIAS},base_url={relay.url}/v1/completions,tokenizer_backend=remote,"
        f"auth_token={relay.key},num_concurrent=1,max_retries=1,timeout=120"
    )
    command = [
        sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
        "--tasks", "baton_choice,baton_until", "--include_path", str(LM_EVAL_TASKS),
        "--output_path", str(tmp_path / "out"), "--batch_size", "2", "--log_samples",
    ]  # fmt: skip
    # (cwd: the tasks' data_files are relative to it)
    run = subprocess.run(
        command, env=_offline_env(relay), capture_output=True, text=True, timeout=540, cwd=LM_EVAL_TASKS
    )
    assert run.returncode == 0, run.stderr[-4000:]
    (results_file,) = list((tmp_path / "out").rglob("results_*.json"))
    results = json.loads(results_file.read_text())["results"]
    # SmolLM2-135M knows these: the capital, the colour of the sky, the number after three
    assert results["baton_choice"]["acc,none"] >= 2 / 3
    generated = [
        json.loads(line)["resps"] for path in (tmp_path / "out").rglob("samples_baton_until_*.jsonl")
        for line in path.read_text().splitlines()
    ]  # fmt: skip
    assert len(generated) == 3 and all(r[0][0] and "\n" not in r[0][0] for r in generated)  # cut at "until"
    assert results["baton_until"]["exact_match,none"] >= 1 / 3, generated


LITELLM_SCRIPT = """
import json, sys
import litellm
url, key = sys.argv[1], sys.argv[2]
reply = litellm.completion(model="openai/smollm2", api_base=url + "/v1", api_key=key, max_tokens=8,
                           temperature=0, messages=[{"role": "user", "content": "Say hello."}])
stream = litellm.completion(model="openai/smollm2", api_base=url + "/v1", api_key=key, max_tokens=8,
                            temperature=0, stream=True, messages=[{"role": "user", "content": "Say hello."}])
streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
print(json.dumps({"text": reply.choices[0].message.content, "streamed": streamed,
                  "completion_tokens": reply.usage.completion_tokens}))
"""


@pytest.mark.timeout(300)
def test_litellm_openai_route_streamed_and_not(relay: Relay) -> None:
    run = subprocess.run(
        [sys.executable, "-c", LITELLM_SCRIPT, relay.url, relay.key], env=_offline_env(relay),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    answer = json.loads(run.stdout.strip().splitlines()[-1])
    assert answer["text"] and answer["text"] == answer["streamed"] and 0 < answer["completion_tokens"] <= 8
