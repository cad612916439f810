"""Settings resolution: CLI flag > EMBER_* env > --config TOML > built-in default, for engine and server flags."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from engine.config import EngineConfig
from server.cli.config_resolve import ConfigError, env_name
from server.cli.engine_args import engine_config_from_args
from server.cli.main import build_parser, main, resolve_args

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No EMBER_* variable of the calling shell may leak into these tests."""
    import os

    for name in [n for n in os.environ if n.startswith("EMBER_")]:
        monkeypatch.delenv(name)


def write_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "ember.toml"
    path.write_text(text)
    return str(path)


def test_defaults_when_nothing_is_set() -> None:
    args, printed = resolve_args(["serve"])
    assert printed is None
    assert (args.dtype, args.max_running_requests, args.decode_buckets) == ("auto", 32, (1, 2, 4, 8, 16, 24, 32))
    assert (args.host, args.port, args.disable_compile, args.model) == ("127.0.0.1", 8000, False, None)


def test_each_source_wins_over_the_ones_below(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = write_config(tmp_path, 'dtype = "float32"\nmax-running-requests = 4\nport = 9001\nmax_n = 3\n')
    monkeypatch.setenv("EMBER_MAX_RUNNING_REQUESTS", "6")
    monkeypatch.setenv("EMBER_PORT", "9002")
    args, _ = resolve_args(["serve", "--config", cfg, "--port", "9003", "--chunked-prefill-size", "256"])
    assert args.port == 9003  # flag over env over config
    assert args.max_running_requests == 6  # env over config
    assert args.dtype == "float32" and args.max_n == 3  # config over default (engine and server)
    assert args.chunked_prefill_size == 256 and args.mem_fraction == 0.3


def test_kv_cache_dtype_reaches_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine_config_from_args(resolve_args(["serve"])[0]).kv_cache_dtype == "auto"
    monkeypatch.setenv("EMBER_KV_CACHE_DTYPE", "int8")
    config = engine_config_from_args(resolve_args(["serve", "--dtype", "float32"])[0])
    assert config.kv_cache_dtype == "int8" and config.kv_cache_dtype_name == "int8"
    assert EngineConfig(dtype="float32").kv_cache_dtype_name == "float32"  # auto: the serving dtype
    assert EngineConfig().kv_cache_dtype_name == "bfloat16"
    assert str(EngineConfig(dtype="float32", kv_cache_dtype="fp8_e4m3").kv_torch_dtype) == "torch.float8_e4m3fn"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")


def test_a_flag_equal_to_the_default_still_beats_env_and_config(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = write_config(tmp_path, 'dtype = "float32"\ndisable-compile = true\n')
    monkeypatch.setenv("EMBER_DTYPE", "float32")
    args, _ = resolve_args(["serve", "--config", cfg, "--dtype", "bfloat16", "--no-disable-compile"])
    assert args.dtype == "bfloat16" and args.disable_compile is False


def test_print_config_names_each_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path, "max-total-tokens = 4096\ndecode-buckets = [1, 2]\n")
    monkeypatch.setenv("EMBER_CONFIG", cfg)
    monkeypatch.setenv("EMBER_HOST", "0.0.0.0")
    monkeypatch.setenv("EMBER_API_KEY", "sekrit")
    assert main(["serve", "--dtype", "float32", "--print-config"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split(maxsplit=1)[1] for line in out.splitlines() if line.startswith("--")}
    assert f"{cfg} (from EMBER_CONFIG)" in out
    assert re.fullmatch(r"float32\s+flag", rows["--dtype"])
    assert re.fullmatch(r"0\.0\.0\.0\s+env \(EMBER_HOST\)", rows["--host"])
    assert re.fullmatch(rf"4096\s+config \({re.escape(cfg)}\)", rows["--max-total-tokens"])
    assert re.fullmatch(rf"1,2\s+config \({re.escape(cfg)}\)", rows["--decode-buckets"])
    assert re.fullmatch(r"8000\s+default", rows["--port"])
    assert "sekrit" not in out and "(set, hidden)" in rows["--api-key"]


def test_env_values_go_through_the_flag_types(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_DECODE_BUCKETS", "1,4")
    monkeypatch.setenv("EMBER_DISABLE_COMPILE", "true")
    monkeypatch.setenv("EMBER_MEM_FRACTION", "0.5")
    args, _ = resolve_args(["compile"])
    assert args.decode_buckets == (1, 4) and args.disable_compile is True and args.mem_fraction == 0.5


@pytest.mark.parametrize(("name", "value", "culprit"), [
    ("EMBER_PORT", "eighty", "EMBER_PORT"),
    ("EMBER_DTYPE", "float16", "float16"),
    ("EMBER_DISABLE_COMPILE", "maybe", "EMBER_DISABLE_COMPILE"),
    ("EMBER_DECODE_BUCKETS", "1,x", "EMBER_DECODE_BUCKETS"),
])
def test_bad_env_values_fail_naming_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str,
                                                 culprit: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=culprit):
        resolve_args(["serve"])


@pytest.mark.parametrize(("text", "culprit"), [
    ("max-running-requests = 2.5\n", "max-running-requests"),
    ('max-running-requests = "8"\n', None),  # a string that converts is accepted, like the flag
    ("dtype = 16\n", "dtype"),
    ('dtype = "float16"\n', "float16"),
    ("disable-compile = 1\n", "disable-compile"),
    ("max-runing-requests = 8\n", "max_runing_requests"),  # a typo is an error, not silently ignored
    ("[engine]\ndtype = \"float32\"\n", "tables"),
    ("dtype = \n", "not valid TOML"),
])
def test_bad_config_values_fail_naming_the_key(tmp_path: Path, text: str, culprit: str | None) -> None:
    cfg = write_config(tmp_path, text)
    if culprit is None:
        assert resolve_args(["serve", "--config", cfg])[0].max_running_requests == 8
        return
    with pytest.raises(ConfigError, match=culprit):
        resolve_args(["serve", "--config", cfg])


def test_missing_config_file_is_an_error_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", "/nonexistent/ember.toml", "--print-config"]) == 2
    assert "/nonexistent/ember.toml does not exist" in capsys.readouterr().err


def test_server_keys_are_ignored_by_commands_without_them(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, "port = 9000\nmax_running_requests = 3\n")
    args, _ = resolve_args(["compile", "--config", cfg])
    assert args.max_running_requests == 3 and not hasattr(args, "port")


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_resolve_to_valid_engine_configs(path: Path) -> None:
    args, _ = resolve_args(["serve", "--config", str(path)])
    config = engine_config_from_args(args)
    assert isinstance(config, EngineConfig)
    assert config.max_total_tokens is not None  # a fixed KV pool, so compiled graphs match across machines


def help_entries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's help entry in `parser`'s --help, keyed by its first flag, wrapped lines joined."""
    entries: dict[str, str] = {}
    current = ""
    for line in parser.format_help().splitlines():
        m = re.match(r"^  (-[-\w]+)", line)
        if m:
            current = m.group(1)
            entries[current] = line
        elif current and line.startswith("   "):
            entries[current] += " " + line.strip()
        else:
            current = ""
    return {flag: " ".join(text.split()) for flag, text in entries.items()}


def test_serve_help_documents_every_setting_with_default_and_env() -> None:
    _, commands, dests = build_parser()
    entries = help_entries(commands["serve"])
    for dest in dests:
        entry = entries["--" + dest.replace("_", "-")]
        assert "default" in entry, entry
        assert env_name(dest) in entry, entry
    assert "--config" in entries and "--print-config" in entries


def test_compile_with_compile_disabled_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compile", "--disable-compile"]) == 2
    assert "nothing to compile" in capsys.readouterr().err


def test_parsers_hold_only_builtin_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The env is applied by the resolver alone: a parser built under EMBER_* vars keeps the built-in defaults."""
    monkeypatch.setenv("EMBER_DTYPE", "float32")
    _, commands, _ = build_parser()
    assert commands["generate"].get_default("dtype") == "auto"
    assert isinstance(commands["serve"], argparse.ArgumentParser)


@pytest.mark.parametrize("preset,want_spin", [({}, "10000"), ({"OMP_WAIT_POLICY": "PASSIVE"}, None),
                                              ({"GOMP_SPINCOUNT": "0"}, "0")])
def test_openmp_spin_default_yields_to_an_explicit_choice(monkeypatch: pytest.MonkeyPatch,
                                                          preset: dict[str, str], want_spin: str | None) -> None:
    from server.cli import main as cli

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # set-then-delete: monkeypatch restores the original
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for k, v in preset.items():
        monkeypatch.setenv(k, v)
    cli._set_thread_env()
    assert cli.os.environ.get("GOMP_SPINCOUNT") == want_spin
    assert cli.os.environ.get("OMP_WAIT_POLICY") == preset.get("OMP_WAIT_POLICY")


def test_compile_cache_defaults_under_xdg_cache_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from server.cli import engine_args as cli

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cli._default_cache_dir() == str(tmp_path / "ember")


def test_sampling_table_sets_the_sampling_defaults(tmp_path: Path) -> None:
    from server.cli.serve import settings_from_args

    cfg = write_config(tmp_path, 'dtype = "float32"\n[sampling]\ntemperature = 0.2\ntop_p = 0.9\n')
    args, _ = resolve_args(["serve", "--config", cfg])
    assert settings_from_args(args).sampling_overrides == (("temperature", 0.2), ("top_p", 0.9))
    args, _ = resolve_args(["serve", "--config", cfg, "--override-generation-config", '{"top_k": 20}'])
    assert settings_from_args(args).sampling_overrides == (("top_k", 20.0),)  # the flag wins over the table
    bad = write_config(tmp_path, "[sampling]\ntemprature = 0.2\n")
    args, _ = resolve_args(["serve", "--config", bad])
    with pytest.raises(SystemExit, match="temprature"):
        settings_from_args(args)


def test_shipped_smollm2_config_has_the_model_card_sampling() -> None:
    from server.cli.serve import settings_from_args

    args, _ = resolve_args(["serve", "--config", str(CONFIGS / "smollm2.toml")])
    assert dict(settings_from_args(args).sampling_overrides) == {"temperature": 0.2, "top_p": 0.9}
