import json

import pytest

from cluster.requests_file import parse_request, read_requests


def test_prompt_and_prompt_ids_forms(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text(
        json.dumps({"prompt": "Hi", "max_tokens": 5, "stop": "x", "seed": 3})
        + "\n\n"
        + json.dumps({"prompt_ids": [1, 2, 3], "temperature": 0, "priority": 2})
        + "\n"
    )
    a, b = read_requests(f)
    assert a.prompt == "Hi" and a.sampling.max_tokens == 5 and a.sampling.stop == ("x",)
    assert b.prompt_ids == (1, 2, 3) and b.sampling.greedy and b.priority == 2


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"prompt": "a", "max_tokens": 0}, "max_tokens=0"),
        ({"prompt": "a", "temperature": -1}, "temperature=-1"),
        ({"prompt": "a", "top_p": 1.5}, "top_p=1.5"),
        ({"prompt": "a", "max_tokens": "5"}, "'max_tokens' has the wrong type"),
        ({"prompt": "a", "colour": "red"}, "unknown field"),
        ({"prompt_ids": [1, "2"]}, "list of integers"),
        ({"prompt": "a", "prompt_ids": [1]}, "exactly one of"),
        ({}, "exactly one of"),
        ({"prompt": "   "}, "prompt is empty"),
    ],
)
def test_bad_requests_are_named(obj, message):
    with pytest.raises(ValueError, match=message):
        parse_request(obj, "line 7")


def test_bad_json_names_file_and_line(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text('{"prompt": "ok"}\n{oops\n')
    with pytest.raises(ValueError, match=r"r.jsonl:2: not valid JSON"):
        read_requests(f)
