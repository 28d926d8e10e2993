"""SGLang frontend programs run against a live server (a helper of tests/test_frontend.py, not a test file).

    SGLANG_COMPACT_CPU_SHIM=1 python tests/frontend_client.py http://127.0.0.1:PORT

runs `doc_qa` (a long shared document, two `sgl.gen` turns) with `run_batch`
over QUESTIONS at temperature 0 through `sgl.RuntimeEndpoint`, and prints one
JSON line: per program, both answers and their meta info (prompt/cached tokens).
`import sglang` needs the CPU shim on a machine without CUDA (torchvision,
sgl_kernel): the caller sets SGLANG_COMPACT_CPU_SHIM=1 (the .pth hook of
scripts/setup_cpu.sh).
"""

from __future__ import annotations

import json
import sys

STATIONS = ["Arden", "Bexley", "Corran", "Dunmore", "Elgin", "Fenwick", "Garvie", "Halden", "Islay", "Jarrow",
            "Kelso", "Lorne", "Moray", "Nairn", "Oban", "Perth"]
CROPS = ["barley", "oats", "rye", "potatoes", "turnips", "kale", "beans", "flax"]
MONTHS = ["March", "April", "May", "June", "July", "August"]

SYSTEM = "You are a careful assistant. Answer questions about the document below, briefly and only from it."
QUESTIONS = [
    "Which station recorded the most rainfall, and how much?",
    "What did the Corran station plant?",
    "Summarise the report's conclusion in one sentence.",
]


def document() -> str:
    """A deterministic field report (~1300 SmolLM2 tokens) whose facts the questions ask about."""
    paras = ["Field report of the northern agricultural stations, season summary.",
             "This report collects the observations of sixteen stations over the growing season. Each station "
             "recorded its rainfall, its main crop, the month of sowing and the yield it measured at harvest. "
             "The stations are listed in the order in which their reports arrived at the central office."]
    for i, name in enumerate(STATIONS):
        rain = 310 + (i * 137) % 420
        crop, month = CROPS[(i * 3) % len(CROPS)], MONTHS[(i * 5) % len(MONTHS)]
        yield_t = 2.1 + ((i * 7) % 19) / 10
        soil = ["heavy clay", "light sand", "peaty loam", "stony till"][i % 4]
        weather = ["early frosts", "late storms", "dry spell in midsummer", "strong westerly winds"][(i * 3) % 4]
        effect = ["cut the yield slightly", "did little harm", "delayed the harvest by a week",
                  "damaged the young plants"][(i + 1) % 4]
        paras.append(
            f"Station {name} sowed {crop} in {month}. It recorded {rain} millimetres of rain over the season "
            f"and a yield of {yield_t:.1f} tonnes per hectare. The station keeper noted that the soil was "
            f"{soil} and that the {weather} {effect}.")
    paras.append("Conclusion: the wettest stations did not give the best yields; stations on peaty loam did best "
                 "overall, and the office recommends sowing oats earlier next season at the western stations.")
    return "\n\n".join(paras)


def run(base_url: str) -> dict:
    import sglang as sgl

    @sgl.function
    def doc_qa(s, doc, question):
        s += sgl.system(SYSTEM + "\n\n" + doc)
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=8, temperature=0))
        s += sgl.user("Now answer again in at most five words.")
        s += sgl.assistant(sgl.gen("short", max_tokens=4, temperature=0))

    backend = sgl.RuntimeEndpoint(base_url, chat_template_name="chatml")  # SmolLM2-Instruct's template
    doc = document()
    states = doc_qa.run_batch([{"doc": doc, "question": q} for q in QUESTIONS], backend=backend, temperature=0,
                              progress_bar=False)
    out = []
    for q, st in zip(QUESTIONS, states):
        row = {"question": q}
        for name in ("answer", "short"):
            meta = st.get_meta_info(name) or {}
            row[name] = st[name]
            row[name + "_meta"] = {k: meta.get(k) for k in ("prompt_tokens", "cached_tokens", "completion_tokens")}
        out.append(row)
    return {"programs": out, "system": SYSTEM + "\n\n" + doc}


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])))
