"""Message codec: round trips on every channel, malformed frames dropped (never raised),
no torch import in msgs/."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from msgs import channels, client, control, done, outputs, requests, steps
from msgs.codec import pack_f32, pack_ids, unpack_f32, unpack_ids
from msgs.params import SamplingParams

SAMPLES = [
    (
        channels.REQUESTS.codec,
        requests.TokenizedRequest(rid="a", input_ids=pack_ids([1, 2, 3]), params=SamplingParams(seed=5)),
    ),
    (channels.REQUESTS.codec, requests.AbortRequest(rid="a")),
    (
        channels.OUTPUTS.codec,
        outputs.TokenBatch(
            outs=[outputs.ReqOutput(rid="a", new_ids=[7], finish_reason="stop", top_logprobs=[[(1, -0.5)]])]
        ),
    ),
    (
        channels.STEPS.codec,
        steps.Step(
            seq=3,
            ops=[
                steps.AddReq(
                    slot=0,
                    rid="a",
                    prompt_ids=pack_ids([1]),
                    sampling=steps.WorkerSampling(
                        temperature=0.0,
                        top_p=1.0,
                        top_k=-1,
                        min_p=0.0,
                        repetition_penalty=1.0,
                        frequency_penalty=0.0,
                        presence_penalty=0.0,
                        seed=1,
                        logprobs=False,
                        top_logprobs=0,
                    ),
                ),
                steps.ExtendPages(slot=0, pages=pack_ids([4, 5])),
                steps.DigestCheck(),
                steps.FreeReq(slot=1),
                steps.CachePages(pages=pack_ids([4])),
                steps.EvictPages(pages=pack_ids([4])),
                steps.Flush(),
            ],
            forward=steps.Forward(
                slots=pack_ids([0]),
                input_ids=pack_ids([1, -1]),
                start_pos=pack_ids([0]),
                extend_lens=pack_ids([2]),
                sample=pack_ids([1]),
            ),
        ),
    ),
    (channels.DONE.codec, done.StepDone(seq=3, rank=0, token_ids=pack_ids([9]), digest="ab")),
    (channels.CONTROL.codec, control.Ready(proc="worker", rank=0, info={"x": "y"})),
    (channels.NOTICES.codec, control.ProcessDied(proc="worker-0", reason="killed by SIGKILL")),
    (channels.SDK_IN.codec, client.GenerateRequest(rid="r", params=SamplingParams(), input_ids=[1, 2])),
    (channels.SDK_OUT.codec, client.GenerateError(rid="r", status=400, message="bad")),
]


@pytest.mark.parametrize("codec,msg", SAMPLES)
def test_round_trip(codec, msg) -> None:
    assert codec.decode(codec.encode(msg)) == msg


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",
        b"garbage",
        msgspec.msgpack.encode({"type": "Nope"}),
        msgspec.msgpack.encode({"type": "AbortRequest", "rid": 5}),
    ],
)
def test_malformed_frames_are_dropped(frame: bytes) -> None:
    assert channels.REQUESTS.codec.decode(frame) is None


def test_message_of_another_channel_is_rejected() -> None:
    assert channels.STEPS.codec.decode(channels.REQUESTS.codec.encode(requests.AbortRequest(rid="x"))) is None


def test_packed_arrays() -> None:
    assert unpack_ids(pack_ids([0, -1, 2**31 - 1])) == [0, -1, 2**31 - 1]
    assert unpack_f32(pack_f32([0.5, -1.25])) == [0.5, -1.25]


def test_sampling_params_validation() -> None:
    assert SamplingParams().validate() is None
    assert "temperature" in SamplingParams(temperature=-1).validate()
    assert "top_logprobs" in SamplingParams(top_logprobs=3).validate()
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"bogus": 1}', type=SamplingParams)


def test_msgs_never_imports_torch() -> None:
    code = (
        "import sys, msgs.sdk, msgs.steps, msgs.done, msgs.outputs, msgs.requests, msgs.control; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
