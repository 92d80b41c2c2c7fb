"""Preparing ShareGPT conversations from a parquet file with `--data HFDataset`, next to `datasets.map` with
transformers' `apply_chat_template` at the same number of processes: wall time, peak memory while preparing,
and the memory a rank adds by loading the prepared cache.

python benchmarks/bench_prepare_hf_dataset.py [--sizes 100000 500000] [--repeats 3] [--out benchmarks/results/prepare_hf_dataset_cpu.txt]
python benchmarks/bench_prepare_hf_dataset.py --input jsonl   # the same rows as JSON Lines (--data JSON); json: one list

`--input jsonl` or `json` writes the same rows as a JSON Lines file or as one JSON list (indented as FastChat
writes its ShareGPT files), prepared with `--data JSON`; `datasets.map` loads them with its json builder.

Each measurement runs in a fresh process, from empty caches, so its peak resident memory is its own (VmHWM:
not ru_maxrss, which a child started by subprocess inherits from the benchmark); litsft's forked tokenizing
workers are reported separately (their largest, not their sum), as are `datasets.map`'s, and beside each peak
the largest anonymous (RssAnon) and file-backed (RssFile: memory-mapped files such as `datasets`' arrow cache,
pages the kernel can drop and read again) memory sampled every 50 ms. Both tokenize with all the cores this
process may use (litsft's `--data.tokenize_processes`, `datasets.map`'s `num_proc`). Each size runs both
`--repeats` times, alternating which goes first, and reports the medians and the median of the pairs' ratios:
on a shared machine one run of each says little. Beside the wall time, the CPU time of each side's processes
(workers included), which others' jobs on the machine change far less. `datasets.map` computes token ids only
(no loss masks) and writes them into its arrow cache; litsft renders, tokenizes, masks and writes its
memory-mapped cache.

`--lengths realistic` writes conversations of Infinity-Instruct-like lengths (about 340 tokens on average, a
long tail: `realistic_conversation`) instead of the short ones (about 61 tokens); the memory of preparing and
of holding the prepared samples grows with both the count and the lengths.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu red green blue cat dog".split()


REALISTIC_MEAN_WORDS = 82
"""Words a realistic conversation holds on average: about 340 tokens with the demo tokenizer (4 tokens a
word) and the chat template's. Infinity-Instruct's cards give 1,472 bytes a conversation for its 7M set
(10,961,808,333 bytes, 7,449,106 rows: huggingface.co/datasets/zuom/Infinity-Instruct, dataset_info) and
2,146 for its 3M set (7,431,951,776 bytes, 3,463,473 rows: huggingface.co/datasets/jrahn/Infinity-Instruct),
about 340-500 tokens at 4.3 bytes a token of English text."""
REALISTIC_SIGMA = 1.0
"""The spread of the log of a conversation's length (a log-normal distribution: an assumption, not fitted to
the dataset): the median is 0.61 of the mean, one conversation in 100 is 10 times the median and one in
1,000 about 22 times, capped at REALISTIC_MAX_WORDS."""
REALISTIC_MAX_WORDS = 4_000
"""The longest realistic conversation, in words (about 16,000 tokens)."""


def realistic_conversation(rng: random.Random, index: int) -> list[dict[str, str]]:
    """A conversation of log-normal length (REALISTIC_MEAN_WORDS, REALISTIC_SIGMA: a long tail of a few
    thousand tokens), one exchange in most, two in one of four and three in one of sixteen; a reply holds
    three quarters of its exchange's words, as an answer is longer than its question."""
    mu = math.log(REALISTIC_MEAN_WORDS) - REALISTIC_SIGMA**2 / 2  # so that the mean is REALISTIC_MEAN_WORDS
    words = min(REALISTIC_MAX_WORDS, max(4, round(rng.lognormvariate(mu, REALISTIC_SIGMA))))
    exchanges = 1 + (index % 4 == 0) + (index % 16 == 0)
    turns = []
    for exchange in range(exchanges):
        share = words // exchanges + (words % exchanges if exchange == 0 else 0)
        question = max(1, share // 4)
        turns += [
            {"from": "human", "value": " ".join(rng.choices(WORDS, k=question)) + "?"},
            {"from": "gpt", "value": " ".join(rng.choices(WORDS, k=max(1, share - question))) + "."},
        ]
    return turns


LENGTHS = {
    "short": "a 3-8 word question and a 2-6 word answer, twice in one conversation of four (61 tokens a "
    "conversation on average, at most about 150)",
    "realistic": f"log-normal, about 340 tokens a conversation on average (median about 210, 1 in 100 above "
    f"about 2,000, at most {REALISTIC_MAX_WORDS * 4:,}), as Infinity-Instruct's bytes a row suggest (see "
    "REALISTIC_MEAN_WORDS)",
}


def write_rows(path: Path, num_rows: int, lengths: str = "short") -> None:
    """Infinity-Instruct-shaped rows: a human question of 3-8 words and a 2-6 word answer, twice in one
    conversation out of four; a .parquet, .jsonl or .json file (one list, each record indented)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)

    def turn() -> list[dict[str, str]]:
        return [
            {"from": "human", "value": " ".join(rng.choices(WORDS, k=rng.randint(3, 8))) + "?"},
            {"from": "gpt", "value": " ".join(rng.choices(WORDS, k=rng.randint(2, 6))) + "."},
        ]

    writer = None
    for start in range(0, num_rows, 100_000):
        rows = [
            {
                "id": str(index),
                "conversations": realistic_conversation(rng, index)
                if lengths == "realistic"
                else turn() + (turn() if index % 4 == 0 else []),
                "source": "bench",
            }
            for index in range(start, min(start + 100_000, num_rows))
        ]
        if path.suffix != ".parquet":
            with open(path, "a" if start else "w") as file:
                if path.suffix == ".jsonl":
                    file.writelines(json.dumps(row) + "\n" for row in rows)
                else:
                    items = (textwrap.indent(json.dumps(row, indent=2), "  ") for row in rows)
                    file.write(("[\n" if not start else ",\n") + ",\n".join(items))
            continue
        table = pa.Table.from_pylist(rows)
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    if writer is not None:
        writer.close()
    if path.suffix == ".json":
        with open(path, "a") as file:
            file.write("\n]\n")


def resident_mb(field: str = "VmRSS") -> float:
    """This process's resident memory now (VmRSS; RssAnon, RssFile: of it anonymous, file-backed), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peaks() -> dict[str, float]:
    """This process's peak resident memory (VmHWM) and its children's largest (ru_maxrss), in MB.

    Not this process's ru_maxrss: Linux carries a process's peak across exec, so a child started by
    subprocess reports the benchmark's own peak (the rows it wrote to parquet) as its own. A forked worker's
    ru_maxrss is its own."""
    return {
        "peak_rss_mb": _status_kb(Path("/proc/self/status"), "VmHWM") / 1024,
        "worker_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def cpu_seconds() -> float:
    """CPU time (user and system) of this process and of its children that have ended (its workers)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def _status_kb(status: Path, field: str) -> int:
    for line in status.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


class ResidentSampler:
    """Samples a process and its descendants every INTERVAL_S from outside (a thread inside would change
    how litsft starts its workers): the peaks of anonymous memory (RssAnon: heap, Python objects, arrays)
    and of file-backed pages (RssFile: memory-mapped files such as `datasets`' arrow cache, which the
    kernel can drop and read again), for the process and for its largest descendant, in MB. Each peak is
    sampled on its own: the two need not be at the same moment."""

    INTERVAL_S = 0.05

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peaks = {"main_anon": 0.0, "main_file": 0.0, "worker_anon": 0.0, "worker_file": 0.0}
        self.peaks.update(tree_rss=0.0, tree_pss=0.0)

    def sample(self) -> None:
        tree_rss = tree_pss = 0.0
        for pid in [self.pid, *self._descendants()]:
            role = "main" if pid == self.pid else "worker"
            try:
                status = Path(f"/proc/{pid}/status")
                anon, file = _status_kb(status, "RssAnon") / 1024, _status_kb(status, "RssFile") / 1024
                # The whole tree: the sum of RSS counts a forked worker's pages shared with its parent twice,
                # the sum of PSS shares each page among the processes mapping it.
                tree_rss += _status_kb(status, "VmRSS") / 1024
                tree_pss += _status_kb(Path(f"/proc/{pid}/smaps_rollup"), "Pss") / 1024
            except OSError:  # it ended
                continue
            self.peaks[f"{role}_anon"] = max(self.peaks[f"{role}_anon"], anon)
            self.peaks[f"{role}_file"] = max(self.peaks[f"{role}_file"], file)
        self.peaks["tree_rss"] = max(self.peaks["tree_rss"], tree_rss)
        self.peaks["tree_pss"] = max(self.peaks["tree_pss"], tree_pss)

    def _descendants(self) -> list[int]:
        parents = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    stat = Path(f"/proc/{name}/stat").read_bytes()
                except OSError:
                    continue
                parents[int(name)] = int(stat.rsplit(b")", 1)[1].split()[1])
        found, frontier = [], {self.pid}
        while frontier:
            frontier = {pid for pid, parent in parents.items() if parent in frontier}
            found += frontier
        return found


def litsft_prepare(parquet: str, tokenizer_dir: str, cache_dir: str, processes: str) -> None:
    """Child process: what rank 0 does before training, timed; one JSON line."""
    # Imported before the clock starts, as datasets_map imports `datasets` (and pyarrow with it); litsft
    # reads a local parquet file with pyarrow alone, so `datasets` is not imported (nor counted) here.
    import pyarrow.parquet  # noqa: F401

    from litsft.data.tokenizer import Tokenizer

    start, cpu_start = time.perf_counter(), cpu_seconds()
    data = data_module(
        parquet, cache_dir=Path(cache_dir), val_split_fraction=0.0, tokenize_processes=int(processes)
    )
    data.connect(Tokenizer(tokenizer_dir), max_seq_length=256, seed=0)
    data.prepare()
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds() - cpu_start, **peaks()}))


def litsft_load(parquet: str, tokenizer_dir: str, cache_dir: str, first_rank: str = "") -> None:
    """Child process: what every other rank does (setup reads the prepared cache); the memory it adds. With
    `first_rank`, what rank 0 of a run does on a prepared cache: prepare (which finds the cache and reports
    it), then the same; the memory prepare adds is reported on its own."""
    from litsft.data.tokenizer import Tokenizer

    data = data_module(parquet, cache_dir=Path(cache_dir), val_split_fraction=0.05)
    data.connect(Tokenizer(tokenizer_dir), max_seq_length=256, seed=0)
    data.sources()  # every rank reads the parquet file's footer, before setup
    import litsft.data.loader  # noqa: F401 (torch: a rank has imported it long before)

    fields = ("VmRSS", "RssAnon", "RssFile")
    baseline = {field: resident_mb(field) for field in fields}
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on (Linux): the peak of what follows
    start = time.perf_counter()
    if first_rank:
        data.prepare()
    prepared = resident_mb() - baseline["VmRSS"]
    data.setup()
    loader = data.train_dataloader(rank=0, world_size=8, micro_batch_size=4, global_batch_size=32)
    next(iter(loader))
    seconds = time.perf_counter() - start
    added = {field: resident_mb(field) - baseline[field] for field in fields}
    samples = data.train_samples
    print(
        json.dumps(
            {
                "added_mb": added["VmRSS"],
                "added_anon_mb": added["RssAnon"],
                "added_file_mb": added["RssFile"],
                "prepare_added_mb": prepared,
                "peak_added_mb": resident_mb("VmHWM") - baseline["VmRSS"],
                "load_seconds": seconds,
                "samples": len(samples),
                "tokens": samples.num_tokens,
            }
        )
    )


def data_module(path: str, **options: object) -> object:
    """`--data HFDataset` for a parquet file, `--data JSON` for a .json or .jsonl one."""
    from litsft.data import JSON, HFDataset

    if path.endswith(".parquet"):
        return HFDataset(path=path, **options)
    return JSON(json_path=Path(path), **options)


def datasets_map(parquet: str, tokenizer_dir: str, cache_dir: str, processes: str) -> None:
    """Child process: `datasets.map` with transformers' apply_chat_template, token ids only; one JSON line."""
    import datasets
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    roles = {"human": "user", "gpt": "assistant", "system": "system"}

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        conversations = [
            [{"role": roles[turn["from"]], "content": turn["value"]} for turn in conversation]
            for conversation in batch["conversations"]
        ]
        encoded = tokenizer.apply_chat_template(conversations, tokenize=True)
        # Newer transformers return a BatchEncoding, older ones the lists of ids.
        return {"input_ids": encoded["input_ids"] if hasattr(encoded, "keys") else encoded}

    start, cpu_start = time.perf_counter(), cpu_seconds()
    dataset = datasets.load_dataset(
        "parquet" if parquet.endswith(".parquet") else "json",
        data_files={"train": parquet},
        split="train",
        cache_dir=cache_dir,
    )
    dataset.map(tokenize, batched=True, num_proc=int(processes), remove_columns=dataset.column_names)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds() - cpu_start, **peaks()}))


def run_child(function: str, *arguments: str, env: dict[str, str]) -> dict[str, float]:
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_prepare_hf_dataset as b; "
        f"b.{function}(*sys.argv[1:])"
    )
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", code, *arguments], env=env, stdout=stdout, stderr=stderr
        )
        sampler = ResidentSampler(process.pid)
        while process.poll() is None:
            sampler.sample()
            time.sleep(sampler.INTERVAL_S)
        stdout.seek(0), stderr.seek(0)
        if process.returncode:
            raise RuntimeError(f"{function} failed:\n{stderr.read()[-3000:]}")
        return {**json.loads(stdout.read().strip().splitlines()[-1]), **sampler.peaks}


def memory(result: dict[str, float]) -> str:
    """Peak RSS of the main process + its largest worker, then the sampled peaks of anonymous and
    file-backed memory of each."""
    return (
        f"{result['peak_rss_mb']:4,.0f} + {result['worker_peak_rss_mb']:4,.0f} MB "
        f"(anon {result['main_anon']:3,.0f} + {result['worker_anon']:3,.0f}, "
        f"file {result['main_file']:3,.0f} + {result['worker_file']:3,.0f}; whole tree: RSS summed "
        f"{result['tree_rss']:5,.0f}, PSS {result['tree_pss']:5,.0f})"
    )


def measure(
    num_rows: int,
    processes: int,
    repeats: int,
    lengths: str = "short",
    input_format: str = "parquet",
    litsft_only: bool = False,
) -> list[str]:
    """`repeats` pairs of runs, litsft and datasets.map one after the other, the first of the pair
    alternating (so that neither always runs second, on a file the other has just read); each run from
    empty caches. The times are medians and the speed-up the median of the pairs' ratios; peaks are the
    largest of any run. `litsft_only`: litsft's runs alone, "-" in datasets.map's columns."""
    from litsft.data.demo import build_demo_tokenizer

    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        write_rows(root / f"rows.{input_format}", num_rows, lengths)
        build_demo_tokenizer(root / "tokenizer")
        paths = [str(root / f"rows.{input_format}"), str(root / "tokenizer")]
        load_before = os.getloadavg()[0]
        ours, theirs = [], []
        for repeat in range(repeats):
            for side in ("litsft", "map") if repeat % 2 == 0 else ("map", "litsft"):
                if litsft_only and side == "map":
                    continue
                run = root / f"{side}-{repeat}"  # a fresh `datasets` cache (HF_HOME) and litsft cache
                env = {
                    **os.environ,
                    "HF_HOME": str(run / "hf-home"),
                    "HF_HUB_OFFLINE": "1",
                    "TQDM_DISABLE": "1",
                }
                if side == "litsft":
                    ours.append(
                        run_child("litsft_prepare", *paths, str(run / "cache"), str(processes), env=env)
                    )
                else:
                    theirs.append(
                        run_child("datasets_map", *paths, str(run / "cache"), str(processes), env=env)
                    )
        cache = str(root / "litsft-0" / "cache")
        env = {**os.environ, "HF_HOME": str(root / "litsft-0" / "hf-home"), "HF_HUB_OFFLINE": "1"}
        loaded = run_child("litsft_load", *paths, cache, env=env)
        first = run_child("litsft_load", *paths, cache, "first", env=env)
        load_after = os.getloadavg()[0]
    if litsft_only:
        return [
            f"{num_rows:>9,} | {median(ours, 'seconds'):6.1f} s | - | - | {median(ours, 'cpu_seconds'):6.1f} s | "
            f"- | - | {memory(largest(ours))} | - | {loaded['added_mb']:4,.0f} MB (anon "
            f"{loaded['added_anon_mb']:3,.0f}, file {loaded['added_file_mb']:3,.0f}) in "
            f"{loaded['load_seconds']:4.1f} s | {loaded['samples']:,} samples, {loaded['tokens']:,} tokens",
            f"          litsft {seconds(ours)} s; load average {load_before:.1f} before, {load_after:.1f} after",
        ]
    ratios = [their["seconds"] / our["seconds"] for our, their in zip(ours, theirs)]
    cpu_ratios = [their["cpu_seconds"] / our["cpu_seconds"] for our, their in zip(ours, theirs)]
    return [
        f"{num_rows:>9,} | {median(ours, 'seconds'):6.1f} s | {median(theirs, 'seconds'):6.1f} s | "
        f"{statistics.median(ratios):5.2f}x | {median(ours, 'cpu_seconds'):6.1f} s | "
        f"{median(theirs, 'cpu_seconds'):6.1f} s | {statistics.median(cpu_ratios):5.2f}x | {memory(largest(ours))} | {memory(largest(theirs))} | "
        f"{loaded['added_mb']:4,.0f} MB (anon {loaded['added_anon_mb']:3,.0f}, file {loaded['added_file_mb']:3,.0f}) "
        f"in {loaded['load_seconds']:4.1f} s, peak {loaded['peak_added_mb']:4,.0f} MB | rank 0: "
        f"{first['added_mb']:4,.0f} MB (prepare {first['prepare_added_mb']:3,.0f}), peak "
        f"{first['peak_added_mb']:4,.0f} MB | {loaded['samples']:,} samples, {loaded['tokens']:,} tokens",
        f"          each pair: {', '.join(f'{ratio:.2f}x' for ratio in ratios)} (litsft {seconds(ours)} s; "
        f"datasets.map {seconds(theirs)} s), CPU {', '.join(f'{ratio:.2f}x' for ratio in cpu_ratios)}; "
        f"load average {load_before:.1f} before, {load_after:.1f} after",
    ]


def cpu_model() -> str:
    """The processor's model name, as `lscpu` gives it ("Model name"), else its architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def seconds(runs: list[dict[str, float]]) -> str:
    return ", ".join(f"{run['seconds']:.1f}" for run in runs)


def median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def largest(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each peak, the largest over the runs."""
    return {key: max(run[key] for run in runs) for key in runs[0]}


def main(
    sizes: list[int],
    repeats: int,
    out: Path | None,
    lengths: str = "short",
    input_format: str = "parquet",
    litsft_only: bool = False,
) -> None:
    from litsft.data.samples import tokenizing_processes

    processes = tokenizing_processes(max(sizes))
    load_before = os.getloadavg()[0]
    lines = [
        f"ShareGPT conversations from {input_format}, demo tokenizer (ChatML), max_seq_length 256, {processes} processes "
        f"each (litsft's tokenizing workers; datasets.map's num_proc), {repeats} runs of each, alternating",
        f"{lengths} lengths: {LENGTHS[lengths]}",
        "conversations | litsft prepare (median) | datasets.map (median) | speed-up (median of the pairs) | "
        "CPU seconds, all processes: litsft | datasets.map | ratio (median of the pairs) | "
        "litsft peak RSS main + largest worker (of which sampled peaks: anonymous, file-backed) | "
        "the same for datasets.map | RSS a rank adds loading the cache (8-rank split, first batch; of which "
        "anonymous, file-backed) in the time setup and the first batch take, and the peak it adds | "
        "the same for rank 0, which first runs prepare on the prepared cache (what prepare adds) | cache",
    ]
    for num_rows in sizes:
        lines += measure(num_rows, processes, repeats, lengths, input_format, litsft_only)
        print("\n".join(lines[-2:]), flush=True)
    lines.append(
        f"machine: {cpu_model()}, {multiprocessing.cpu_count()} CPUs shared with "
        f"other work (load average before: {load_before:.1f}, after: {os.getloadavg()[0]:.1f}), "
        f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if out is not None:
        out.write_text(text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 500_000, 2_000_000])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, alternating which goes first")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--lengths", choices=list(LENGTHS), default="short", help="conversation lengths")
    parser.add_argument("--input", choices=["parquet", "jsonl", "json"], default="parquet",
                        help="the rows' file type: parquet (--data HFDataset), jsonl or json (--data JSON)")  # fmt: skip
    parser.add_argument("--litsft_only", action="store_true", help="leave datasets.map out (its columns: -)")
    arguments = parser.parse_args()
    main(
        arguments.sizes,
        arguments.repeats,
        arguments.out,
        arguments.lengths,
        arguments.input,
        arguments.litsft_only,
    )
