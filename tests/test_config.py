"""Config loading: YAML + base: inheritance + overrides, and errors that name file and key."""

import dataclasses

import pytest

from k3jax.config import (Config, ConfigError, ModelConfig, config_from_dict, config_to_dict, diff_configs,
                          load_config, parse_layer_pattern)


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_come_from_the_dataclasses_only(tmp_path):
    empty = write(tmp_path, "empty.yaml", "")
    assert load_config(empty) == Config()
    assert load_config(None) == Config()


def test_base_inheritance_and_overrides(tmp_path):
    write(tmp_path, "base.yaml", "model:\n  d_model: 96\n  kda:\n    num_heads: 3\n    head_dim: 32\ntrain:\n  steps: 7\n")
    child = write(tmp_path, "child.yaml", "base: base.yaml\nmodel:\n  kda:\n    head_dim: 16\n")
    cfg = load_config(child, ["train.steps=9", "optimizer.lr=3e-4", "model.moe.qb_estimator=histogram"])
    assert cfg.model.d_model == 96            # from the base
    assert cfg.model.kda.num_heads == 3       # base, merged (not replaced) under the child's kda:
    assert cfg.model.kda.head_dim == 16       # child wins over base
    assert cfg.train.steps == 9               # command line wins over files
    assert cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.model.moe.qb_estimator == "histogram"


def test_unknown_key_names_file_and_suggests(tmp_path):
    p = write(tmp_path, "bad.yaml", "model:\n  d_modle: 64\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "bad.yaml" in msg and "model.d_modle" in msg and "did you mean 'model.d_model'" in msg


def test_unknown_override_key_names_the_command_line():
    with pytest.raises(ConfigError, match=r"command line: optimizer\.lrr.*did you mean 'optimizer\.lr'"):
        load_config(None, ["optimizer.lrr=1"])


def test_top_level_typo_names_its_source(tmp_path):
    # on the command line: the key is set only through a child, so the place is the child's
    with pytest.raises(ConfigError) as e:
        load_config(None, ["optimzer.lr=1e-3"])
    assert str(e.value) == "command line: optimzer: unknown key 'optimzer'; did you mean 'optimizer'?"
    # in a file: its own line (3), also when it reaches the run through another file's `base:`
    base = write(tmp_path, "typo.yaml", "train:\n  steps: 3\noptimzer:\n  lr: 1.0e-3\n")
    child = write(tmp_path, "child.yaml", "base: typo.yaml\nmodel:\n  d_model: 64\n")
    for path in (base, child):
        with pytest.raises(ConfigError) as e:
            load_config(path)
        assert str(e.value) == f"{base}:3: optimzer: unknown key 'optimzer'; did you mean 'optimizer'?"
    # a command-line list replaces the file's: its keys' places are the command line's, not the file's
    p = write(tmp_path, "d.yaml", "data:\n  sources:\n    - {type: mqar, weight: 2}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, ["data.sources=[{type: mqar, wieght: 2}]"])
    assert str(e.value).startswith("command line: data.sources.0.wieght: unknown key")


def test_wrong_type_and_bad_literal(tmp_path):
    p = write(tmp_path, "t.yaml", "train:\n  steps: many\n")
    with pytest.raises(ConfigError, match=r"t\.yaml:2: train\.steps: expected an integer, got 'many'"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"model\.kda\.gate: must be one of .*did you mean 'softplus'"):
        load_config(None, ["model.kda.gate=softplsu"])
    with pytest.raises(ConfigError, match="expected true/false"):
        load_config(None, ["model.scan_layers=3"])



def test_yaml_words_off_and_yes_are_strings_not_booleans(tmp_path):
    """YAML 1.2 booleans (true/false only): the README's `train.compile_cache_dir=off` is the
    string 'off', in a file and on the command line; a bool field given `yes` is refused by name."""
    assert load_config(None, ["train.compile_cache_dir=off"]).train.compile_cache_dir == "off"
    p = write(tmp_path, "c.yaml", "train:\n  compile_cache_dir: off\nlogging:\n  progress: False\n")
    cfg = load_config(p)
    assert cfg.train.compile_cache_dir == "off" and cfg.logging.progress is False
    with pytest.raises(ConfigError, match=r"command line: logging\.progress: expected true/false, got 'yes'"):
        load_config(None, ["logging.progress=yes"])

def test_impossible_values_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.moe\.top_k: must be in 1\.\.num_experts=16, got 20"):
        load_config(None, ["model.moe.top_k=20"])
    p = write(tmp_path, "h.yaml", "model:\n  d_model: 100\n  kda:\n    num_heads: 3\n    head_dim: 0\n")
    with pytest.raises(ConfigError, match=r"h\.yaml:4: model\.kda\.num_heads: num_heads=3 does not divide d_model=100"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"train\.micro_batches: batch_size=8 is not divisible by 3"):
        load_config(None, ["train.micro_batches=3"])
    with pytest.raises(ConfigError, match=r"command line: model\.decode_fused_max_batch: must be >= 0 .*got -1"):
        load_config(None, ["model.decode_fused_max_batch=-1"])
    with pytest.raises(ConfigError, match=r"model\.layer_pattern: unknown mixer 'kdaa'"):
        load_config(None, ["model.layer_pattern=2*(kdaa,mla)"])


def test_missing_file_and_base_cycle(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    write(tmp_path, "a.yaml", "base: b.yaml\n")
    b = write(tmp_path, "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(b)


def test_list_of_sources_and_indexed_override(tmp_path):
    p = write(tmp_path, "d.yaml", "data:\n  sources:\n    - {type: mqar, weight: 2}\n    - {type: stdlib}\n")
    cfg = load_config(p, ["data.sources.1.weight=0.5"])
    assert [s.type for s in cfg.data.sources] == ["mqar", "stdlib"]
    assert cfg.data.sources[0].weight == 2.0 and cfg.data.sources[1].weight == 0.5
    with pytest.raises(ConfigError, match=r"data\.sources\.0\.wieght.*did you mean 'data\.sources\.0\.weight'"):
        load_config(p, ["data.sources.0.wieght=1"])


def test_round_trip_and_diff():
    cfg = load_config(None, ["model.d_model=64", "model.kda.num_heads=2"])
    again = config_from_dict(config_to_dict(cfg))
    assert again == cfg
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=32))
    assert diff_configs(cfg.model, other.model) == [("d_model", 64, 32)]
    # a config saved by an earlier version, with a key since removed, still reads back
    saved = config_to_dict(cfg)
    saved["model"]["max_seq_len"] = 1 << 20
    assert config_from_dict(saved) == cfg
    with pytest.raises(ConfigError, match="unknown key 'model.max_seq_len'"):
        load_config(None, ["model.max_seq_len=4096"])


def test_layer_pattern_grammar():
    k3 = parse_layer_pattern("23*(kda,kda,kda,mla) + mla")
    assert len(k3) == 93
    assert [i for i, m in enumerate(k3) if m == "mla"] == list(range(3, 92, 4)) + [92]
    assert parse_layer_pattern("softmax + 2*kda") == ("softmax", "kda", "kda")
    with pytest.raises(ValueError, match="cannot parse"):
        parse_layer_pattern("2*(kda,mla")
    assert ModelConfig(layer_pattern="3*(kda,mla)").num_layers == 6
