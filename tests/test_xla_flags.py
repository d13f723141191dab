"""The recommended XLA flags: appended when absent, never overriding the user's, opt-out honoured."""

from qspec_jax.xla_flags import RECOMMENDED_GPU_FLAGS, apply_recommended_xla_flags


def test_appends_to_existing_flags() -> None:
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    out = apply_recommended_xla_flags(env)
    assert out.split()[0] == "--xla_force_host_platform_device_count=4"
    for f in RECOMMENDED_GPU_FLAGS:
        assert f in out.split()
    assert env["XLA_FLAGS"] == out


def test_user_setting_wins_and_is_not_duplicated() -> None:
    name = RECOMMENDED_GPU_FLAGS[0].split("=")[0]
    env = {"XLA_FLAGS": f"{name}=true"}
    out = apply_recommended_xla_flags(env)
    assert out.split().count(f"{name}=true") == 1
    assert not any(f.startswith(name) and f != f"{name}=true" for f in out.split())
    assert apply_recommended_xla_flags(env) == out  # idempotent


def test_opt_out_leaves_flags_untouched() -> None:
    env = {"QSPEC_XLA_FLAGS": "0"}
    assert apply_recommended_xla_flags(env) == ""
    assert "XLA_FLAGS" not in env
