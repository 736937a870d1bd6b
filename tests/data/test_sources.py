"""sources.py: the sources of a mixture, from repeated flags or TOML tables, and their names."""

from llama_ddp.train.cli import parse_train_args


def test_sources_come_from_repeated_flags_or_toml_tables(tmp_path):
    from llama_ddp.data.sources import Source, source_name

    (tmp_path / "mix.toml").write_text(
        'preset = "tiny"\ntext-column = "body"\n'
        '[[sources]]\ndataset = "data/code.jsonl"\nweight = 0.7\n'
        '[[sources]]\ndataset = "HuggingFaceFW/fineweb"\nname = "web"\nconfig = "sample-10BT"\n'
        'streaming = true\ntext_column = "text"\nweight = 0.3\nsplit = "train[:90%]"\n'
    )
    cfg = parse_train_args(["--config", str(tmp_path / "mix.toml")])
    assert cfg.data.mixture() == [
        Source("data/code.jsonl", 0.7, "code", text_column="body"),
        Source("HuggingFaceFW/fineweb", 0.3, "web", "sample-10BT", "train[:90%]", streaming=True),
    ]
    flags = ["--config", str(tmp_path / "mix.toml"), "--dataset", "a.jsonl", "--dataset", "b.txt"]
    cfg = parse_train_args([*flags, "--dataset-weights", "3,1"])  # flags replace the tables
    assert cfg.data.mixture() == [
        Source("a.jsonl", 3.0, "a", text_column="body"),
        Source("b.txt", 1.0, "b", text_column="body"),
    ]
    assert parse_train_args([]).data.mixture() == [Source("sample", 1.0, "sample")]
    names = ["data/prose/*.jsonl", "x/web.jsonl.gz", "HuggingFaceFW/fineweb", "./books/"]
    assert [source_name(n) for n in names] == ["prose", "web", "HuggingFaceFW/fineweb", "books"]
