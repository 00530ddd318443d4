"""Speculative decoding on a rewriting task: qkv's prompt lookup and draft model against plain decoding, and against
llama.cpp's own (``llama-server --spec-type ngram-simple`` and ``--model-draft``) on the same files.

    python benchmarks/bench_speculative.py [--rounds 3] [--llama-server PATH]

The task: SmolLM2-135M-Instruct, through its chat template, asked to rewrite a 300-token paragraph replacing one
word; greedy, until the end of its turn (at most 480 tokens). Two settings:

* lookup: the model is the Q4_1 file as stored; drafts come from the prompt and the text so far.
* draft: the model is SmolLM2 in float32 (the Q4_1 file's weights written as F32 by ``qkv export --type f32``,
  made once in ``~/.cache/qkv-bench``: the same text, four times the bytes a token reads), the draft the Q4_1 file.

Every contender runs in its own process (this script with ``--worker``, or ``llama-server``), one after the other
in each round, the order turned around every round; medians over ``--rounds``. Decode tokens/s counts the tokens
after the first over the time after the first (qkv: stamped as they stream; llama.cpp: its ``timings``). Each line
gives the acceptance (accepted / drafted tokens) and whether the text equals plain decoding's (qkv: token for token;
llama.cpp: its plain server's text). llama.cpp drafts at most 16 tokens a step here, as qkv does (``--draft-max``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night its keeper "
    "climbed the narrow spiral stairs, trimmed the wick and polished the great glass lens until it shone. Ships "
    "passing through the dangerous strait relied on its steady beam to find their way between the rocks. In winter "
    "the storms were so fierce that waves broke over the lantern room, and the keeper had to stay awake until dawn."
    " His wife kept a garden behind the cottage, where she grew potatoes, onions and a few stubborn roses that "
    "survived the salt wind. Their children walked four miles to the village school along a path that followed the "
    "shore, and in spring they collected gull eggs from the lower ledges. On clear evenings the keeper sat on the "
    "bench by the door and counted the fishing boats returning to the harbour, writing each one into a heavy "
    "logbook together with the weather, the direction of the wind and the height of the tide. Supplies came by boat"
    " once a month: flour, oil for the lamp, letters and newspapers that were already weeks old. When the last "
    "keeper retired, the lighthouse was fitted with an electric lamp that switched itself on at dusk. The cottage "
    "stood empty for many years, its windows boarded and its garden overgrown with brambles. Visitors now come in "
    "summer to climb the stairs, look out over the sea and read the names of the keepers carved into the wooden "
    "door.")
REQUEST = "Rewrite the following paragraph, replacing the word 'keeper' with 'guardian' and changing nothing else:"
MAX_NEW = 480
F32 = Path.home() / ".cache" / "qkv-bench" / "smollm2-f32.gguf"


def prompt_ids() -> list[int]:
    from qkv.chat import render_chat
    from qkv.interop import load_pretrained
    from qkv.tokenizers import encode_prompt

    pre = load_pretrained("smollm2", weights="none")
    text = render_chat(pre.chat_template, [{"role": "user", "content": f"{REQUEST}\n\n{PARAGRAPH}"}])
    return encode_prompt(pre.tokenizer, text)


def worker(setting: str, drafter: str) -> None:
    """One qkv contender, in this process: prints its result as one JSON line."""
    import torch

    from qkv.generation import LMDecoder, generate
    from qkv.interop import load_pretrained, smollm2_path
    from qkv.quantize import float_layers
    from qkv.speculative import DraftModel, Lookup, Speculation

    ids = prompt_ids()
    source = str(F32) if setting == "draft" else str(smollm2_path())
    target = load_pretrained(source, weights="none" if setting == "draft" else "auto")
    float_layers(target.model)  # as qkv generate holds a float32 model on a CPU (the Q4_1 file's output layer too)
    speculation = None
    if drafter == "lookup":
        speculation = Speculation(Lookup())
    elif drafter == "draft":
        speculation = Speculation(DraftModel(load_pretrained(str(smollm2_path())).model))
    stamps: list[float] = []
    for warm in (True, False):  # a short warm-up, then the timed generation
        stamps.clear()
        decoder = LMDecoder(target.model, [ids])
        with torch.inference_mode():
            out = generate(decoder, start=decoder.start, max_new_tokens=8 if warm else MAX_NEW, context=[ids],
                           stop_ids=set(target.tokenizer.stop_ids), speculation=speculation,
                           on_token=lambda row, token: stamps.append(time.perf_counter()))[0]
        if warm and speculation is not None:
            speculation.drafted = speculation.accepted = 0
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    print(json.dumps({"tokens": out, "rate": rate, "drafted": speculation.drafted if speculation else 0,
                      "accepted": speculation.accepted if speculation else 0}))


def run_qkv(setting: str, drafter: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--worker", setting, drafter], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_llama(server: str, setting: str, drafter: str, ids: list[int]) -> dict:
    """One llama-server process with the setting's model (and its drafting), one request, its timings."""
    from qkv.interop import smollm2_path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = str(F32) if setting == "draft" else str(smollm2_path())
    command = [server, "-m", model, "--port", str(port), "-c", "2048", "-np", "1"]
    if drafter == "lookup":
        command += ["--spec-type", "ngram-simple", "--spec-draft-n-max", "16"]
    elif drafter == "draft":
        command += ["-md", str(smollm2_path()), "--spec-draft-n-max", "16"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        body = {"prompt": ids, "n_predict": MAX_NEW, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "return_tokens": True}
        request = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            reply = json.loads(r.read())
    finally:
        proc.terminate()
        proc.wait()
    timings = reply.get("timings", {})
    return {"tokens": reply.get("tokens", []), "text": reply.get("content", ""),
            "rate": timings.get("predicted_per_second", 0.0), "drafted": timings.get("draft_n", 0),
            "accepted": timings.get("draft_n_accepted", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (else $LLAMA_SERVER or the PATH)")
    parser.add_argument("--worker", nargs=2, metavar=("SETTING", "DRAFTER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    if not F32.is_file():
        F32.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["qkv", "export", "--pretrained", "smollm2", "--format", "gguf", "--type", "f32", "--out",
                        str(F32)], check=True)
    server = args.llama_server or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    ids = json.loads(subprocess.run([sys.executable, "-c", "import json, bench_speculative as b; "
                                     "print(json.dumps(b.prompt_ids()))"], capture_output=True, text=True,
                                    check=True, cwd=Path(__file__).parent).stdout)
    print(f"prompt {len(ids)} tokens (the paragraph and the request, in SmolLM2's chat template)")
    contenders = [(who, setting, drafter) for setting, drafters in (("lookup", ("none", "lookup")),
                                                                     ("draft", ("none", "draft")))
                  for drafter in drafters for who in (("qkv", "llama.cpp") if server else ("qkv",))]
    results: dict[tuple, list[dict]] = {c: [] for c in contenders}
    for r in range(args.rounds):
        for who, setting, drafter in contenders if r % 2 == 0 else contenders[::-1]:
            got = run_qkv(setting, drafter) if who == "qkv" else run_llama(server, setting, drafter, ids)
            results[who, setting, drafter].append(got)
            print(f"  round {r + 1}: {who:9} {setting:6} {drafter:6} {got['rate']:6.1f} tokens/s", flush=True)
    if not server:
        print("llama.cpp: no llama-server found (see ../shared/README.md to build it); its rows skipped")
    print(f"\n{'':9} {'model':22} {'drafts':7} {'decode tok/s':>12} {'vs plain':>9} {'accepted':>9} {'same text':>9}")
    for who, setting, drafter in contenders:
        runs = results[who, setting, drafter]
        rate = statistics.median(x["rate"] for x in runs)
        plain = results[who, setting, "none"]
        base = statistics.median(x["rate"] for x in plain)
        same = all(x["tokens"] == plain[0]["tokens"] for x in runs)
        drafted, accepted = runs[-1]["drafted"], runs[-1]["accepted"]
        share = f"{accepted / drafted:.0%}" if drafted else "-"
        model = "SmolLM2 Q4_1" if setting == "lookup" else "SmolLM2 F32 (+Q4_1)"
        print(f"{who:9} {model:22} {drafter:7} {rate:12.1f} {rate / base:8.2f}x {share:>9} {same!s:>9}  "
              f"({len(runs[-1]['tokens'])} tokens)")


if __name__ == "__main__":
    main()
