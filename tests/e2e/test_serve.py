"""serve.py on the tiny trained workdir, under load: concurrent clients get what decode.py
gives each line, nothing is lost or duplicated, overload is refused with 503, and SIGTERM
answers every request in flight before the server exits 0.

One server for the file (tests run in order; the SIGTERM test comes last).
"""

import concurrent.futures
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import ROOT

from flaxformer_lite.models import from_config
from flaxformer_lite.serving.client import Client, ServerError
from flaxformer_lite.training import restore
from flaxformer_lite.translate import constraints, runner, word_alignment

LINES = [
    f"{lang} {n}" for n in (3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26) for lang in ["en", "de"]
]
QUEUE = 8  # sentences waiting at most: the overload test passes it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(trained_tiny):
    port = _free_port()
    args = [
        "--workdir",
        trained_tiny,
        "--port",
        str(port),
        "--slots",
        "4",
        "--beam_size",
        "4",
        "--max_queue",
        str(QUEUE),
        "--max_lines",
        "8",
        "--nowarm_up",
        "--steps_per_sync",
        "2",
    ]
    process = subprocess.Popen(
        [sys.executable, "serve.py", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        text=True,
    )
    client = Client(f"http://127.0.0.1:{port}", timeout=120)
    deadline = time.monotonic() + 120
    while True:
        try:
            client.health()
            break
        except (OSError, ServerError):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"serve.py did not start: {process.communicate()[1][-2000:]}")
            time.sleep(0.2)
    yield process, client
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def reference(trained_tiny):
    """decode.py's library on the same lines: greedy texts, beam 4 (text, score) 2-best."""
    run_config, vocab = runner.open_workdir(trained_tiny)
    params, _ = restore.restore_params(trained_tiny, None)
    model = from_config.build_model(run_config)
    out = {}
    for beam in (1, 4):
        search = runner.make_search(run_config, beam_size=beam, nbest=min(beam, 2))
        result = runner.decode_lines(
            model, params, vocab, run_config, LINES, search=search, nbest=min(beam, 2)
        )
        out[beam] = result.hypotheses
    return out


def _translate_retrying(client: Client, lines, **fields):
    """A well-behaved client: waits the Retry-After of a 503 and sends again."""
    while True:
        try:
            return client.translate(lines, **fields)
        except ServerError as e:
            if e.status != 503:
                raise
            time.sleep(e.retry_after or 0.1)


def test_concurrent_clients_get_decode_py_output_for_every_line(server, reference):
    _, client = server
    chunks = [(i, LINES[i : i + 3]) for i in range(0, len(LINES), 3)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        greedy = pool.map(lambda c: (c[0], _translate_retrying(client, c[1], beam_size=1)), chunks)
        beam = pool.map(
            lambda c: (c[0], _translate_retrying(client, c[1], beam_size=4, nbest=2)), chunks
        )
        greedy, beam = dict(greedy), dict(beam)
    got_greedy = [t["hypotheses"][0]["text"] for i, _ in chunks for t in greedy[i]]
    assert got_greedy == [h[0][0] for h in reference[1]]
    got_beam = [t["hypotheses"] for i, _ in chunks for t in beam[i]]
    assert len(got_beam) == len(LINES)
    for got, want in zip(got_beam, reference[4], strict=True):
        assert [h["text"] for h in got] == [text for text, _ in want]
        assert [h["score"] for h in got] == pytest.approx([s for _, s in want], abs=1e-4)


def test_streamed_pieces_make_the_greedy_translation(server, reference):
    _, client = server
    events = list(client.stream(LINES[3]))
    pieces = "".join(e["text"] for e in events if not e.get("done"))
    final = events[-1]
    assert final["done"] and final["text"] == pieces == reference[1][3][0][0]


def test_alignments_are_those_decode_py_computes_for_the_same_hypotheses(server, trained_tiny):
    _, client = server
    run_config, vocab = runner.open_workdir(trained_tiny)
    params, _ = restore.restore_params(trained_tiny, None)
    model = from_config.build_model(run_config)
    search = runner.make_search(run_config, beam_size=4, nbest=2)
    result = runner.decode_lines(
        model, params, vocab, run_config, LINES[:4], search=search, nbest=2
    )
    want = word_alignment.align_hypotheses(
        model,
        params,
        vocab.target,
        result.sources,
        result.nbest_ids,
        max_source_len=run_config.data.max_source_len,
        target_len=search.max_len + 1,
        source_vocab=vocab.source,
    )
    got = client.translate(LINES[:4], beam_size=4, nbest=2, alignment=True)
    for line, pairs in zip(got, want, strict=True):
        assert [h["alignment"] for h in line["hypotheses"]] == [
            word_alignment.format_pairs(p) for p in pairs
        ]


def test_constrained_requests_contain_their_phrases_as_decode_py_gives_them(server, trained_tiny):
    _, client = server
    run_config, vocab = runner.open_workdir(trained_tiny)
    params, _ = restore.restore_params(trained_tiny, None)
    model = from_config.build_model(run_config)
    phrases = [["forty"], [], ["seven", "two"]]
    want = constraints.decode_constrained(
        model, params, vocab, run_config, LINES[:3], phrases, beam_size=4, nbest=2
    )
    got = client.translate(LINES[:3], beam_size=4, nbest=2, constraints=phrases)
    for line, hyps, wanted in zip(got, want, phrases, strict=True):
        texts = [h["text"] for h in line["hypotheses"]]
        assert texts == [text for text, _ in hyps]
        assert all(p in t for t in texts for p in wanted)
    with pytest.raises(ServerError, match="cannot spell") as e:
        client.translate(LINES[:1], beam_size=4, constraints=[["\u4e2d"]])
    assert e.value.status == 400


def test_bad_lines_get_their_own_error_and_the_others_their_answer(server, reference):
    _, client = server
    got = client.translate(["", LINES[0], "en \ud800", "x" * 5000, LINES[1]], beam_size=1)
    assert got[0] == {"hypotheses": [{"text": "", "score": 0.0}]}
    assert got[1]["hypotheses"][0]["text"] == reference[1][0][0][0]
    assert "lone surrogate" in got[2]["error"] and "over the limit" in got[3]["error"]
    assert got[4]["hypotheses"][0]["text"] == reference[1][1][0][0]


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b'{"text": ["en 1"', 400, "not valid JSON"),
        (b'\xff{"text": 1}', 400, "not UTF-8"),
        (b'{"text": ["en 1"], "beem": 4}', 400, "unknown field 'beem'"),
        (b'{"text": ["en 1"], "beam_size": 9}', 400, "exceeds this server's limit 4"),
        (b'{"text": ["en 1"], "nbest": 3, "beam_size": 2}', 400, "nbest 3"),
        (b'{"text": ["en 1"], "beam_size": 4, "stream": true}', 400, "greedy"),
        (b'{"text": "en 1", "max_len": 0}', 400, "max_len"),
        (json.dumps({"text": ["en 1"] * 9}).encode(), 413, "9 lines exceed the limit of 8"),
    ],
)
def test_bad_requests_get_one_line_and_their_status(server, body, status, words):
    _, client = server
    request = urllib.request.Request(client.url + "/translate", body)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=60)
    assert e.value.code == status
    message = json.loads(e.value.read())["error"]
    assert words in message and "\n" not in message


def test_a_body_over_the_size_limit_is_refused_before_it_is_read(server):
    _, client = server
    connection = http.client.HTTPConnection(client.url.split("//")[1], timeout=60)
    connection.putrequest("POST", "/translate")
    connection.putheader("Content-Length", str(3 << 20))  # the body itself is never sent
    connection.endheaders()
    answer = connection.getresponse()
    assert answer.status == 413
    assert "over the limit of 1048576" in json.loads(answer.read())["error"]
    connection.close()


def test_overload_is_refused_with_retry_after_and_every_accepted_request_answered(
    server, reference
):
    _, client = server
    refused_before = _count(client.metrics(), 'flaxformer_lite_requests_total{code="503"}')

    def send(i):
        try:
            return i, client.translate(LINES[i % 8 : i % 8 + 2], beam_size=4)
        except ServerError as e:
            return i, e

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        results = list(pool.map(send, range(24)))  # 48 sentences against a queue of 8
    refused = [r for _, r in results if isinstance(r, ServerError)]
    assert refused and all(e.status == 503 and e.retry_after for e in refused)
    answered = [(i, r) for i, r in results if not isinstance(r, ServerError)]
    assert answered
    for i, translations in answered:
        want = [h[0][0] for h in reference[4][i % 8 : i % 8 + 2]]
        assert [t["hypotheses"][0]["text"] for t in translations] == want
    metrics = client.metrics()
    refused_after = _count(metrics, 'flaxformer_lite_requests_total{code="503"}')
    assert refused_after - refused_before == len(refused)
    assert "flaxformer_lite_queue_depth 0" in metrics
    assert 'flaxformer_lite_slots_busy{pool="beam"} 0' in metrics
    assert "flaxformer_lite_request_latency_seconds_count" in metrics


def _count(metrics: str, name: str) -> float:
    values = [line.split()[-1] for line in metrics.splitlines() if line.startswith(name + " ")]
    return float(values[0]) if values else 0.0


def test_sigterm_answers_the_requests_in_flight_then_exits_0(server, reference):
    process, client = server
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(client.translate, LINES[i : i + 4], beam_size=4) for i in (0, 4)]
        time.sleep(0.3)  # both received (their sentences queued or decoding)
        process.send_signal(signal.SIGTERM)
        answers = [f.result(timeout=120) for f in futures]
    want = [h[0][0] for h in reference[4][:8]]
    assert [t["hypotheses"][0]["text"] for a in answers for t in a] == want
    assert process.wait(timeout=120) == 0
    assert "drained and stopped" in process.stderr.read()
