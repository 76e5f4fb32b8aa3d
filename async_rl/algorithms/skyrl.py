"""A SkyRL ``trainer.algorithm`` section translated into this project's ``algorithm`` keys.

:func:`skyrl_sections` gives the keys of the three sections (``advantage``, ``loss``, ``correction``);
:func:`async_rl.algorithms.config.skyrl_algorithm_config` builds the :class:`AlgorithmConfig` from them (this
module imports no config class, so the config can use it for ``algorithm.from_skyrl``).

Input: a mapping or a YAML file (the whole SkyRL config, its ``trainer`` section or the
``trainer.algorithm`` section itself), or SkyRL command-line overrides
(``trainer.algorithm.policy_loss_type=cispo``; other sections are skipped). Keys left out take
SkyRL's defaults (its ``AlgorithmConfig`` dataclass, 2026-08), not ours: ``{}`` is SkyRL's default
recipe (PPO ``regular`` on π_old, ``use_kl_loss`` with coefficient 0.001).

Every key falls in one of three kinds, listed in ``_SCHEMA`` and in the table of ``docs/algorithms.md``:
mapped (it has an equivalent); inert (SkyRL ignores it as set: a critic's knob, the options of a loss
not chosen, a feature switched off); or a setting with no equivalent here (``policy_loss_type: gspo``,
``use_kl_in_reward: true``...). All settings of the last kind, and keys SkyRL does not know, are named
together in one :class:`SkyRLConfigError`. Torch-free, like every config module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from async_rl.config.configurable import ConfigError

_OFF_POLICY = {
    "tis_ratio_type": None, "token_tis_ratio_clip_high": 2.0, "sequence_tis_ratio_clip_high": 5.0,
    "sequence_mask_metric": None, "geo_mask_high": 1.01, "geo_mask_low": 0.99, "product_mask_high": 2.0,
    "product_mask_low": 0.5, "outlier_token_is_threshold_low": None, "outlier_token_is_threshold_high": None,
    "token_mask_is_threshold_low": None, "token_mask_is_threshold_high": None,
}  # fmt: skip
_SCHEMA: dict[str, Any] = {
    "advantage_estimator": "grpo", "kl_ctrl": {"type": "fixed", "kl_target": 0.1, "horizon": 10000},
    "kl_estimator_type": "k3", "use_kl_in_reward": False, "use_kl_loss": True, "kl_loss_coef": 0.001,
    "use_entropy_loss": False, "entropy_loss_coef": 0.01, "temperature": None, "advantage_batch_normalize": False,
    "value_head_prefix": "value_head", "policy_loss_type": "regular", "loss_reduction": "token_mean",
    "grpo_norm_by_std": True, "zero_variance_filter": False, "zero_variance_filter_tol": 1e-6, "lambd": 1.0,
    "gamma": 1.0, "eps_clip_low": 0.2, "eps_clip_high": 0.2, "clip_ratio_c": 3.0, "tis_imp_ratio_cap": -1.0,
    "use_tis": False, "off_policy_correction": _OFF_POLICY, "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
    "value_clip": 0.2, "dynamic_sampling": {"type": None, "max_sample_batches": 30, "min_replace_ratio": 0.3},
    "clip_cov": {"clip_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
    "kl_cov": {"kl_cov_frac": 0.2, "ppo_kl_coef": 1.0},
    "cispo": {"cispo_eps_clip_low": 1.0, "cispo_eps_clip_high": 4.0, "cispo_anchor": "old"},
    "dppo": {"dppo_type": "binary_tv", "delta_low": 0.2, "delta_high": 0.2}, "max_seq_len": None,
}  # fmt: skip
"""SkyRL's ``trainer.algorithm`` keys and their defaults (NovaSky-AI/SkyRL ``skyrl/train/config/config.py``)."""

_LOSSES = {"regular": "regular", "dual_clip": "dual_clip", "cispo": "cispo", "rollout_is": "rollout_is"}
_REDUCTIONS = {"token_mean": "token_mean", "sequence_mean": "seq_mean_token_mean",
               "seq_mean_token_sum_norm": "token_sum_norm"}  # fmt: skip


class SkyRLConfigError(ConfigError):
    """A SkyRL algorithm section that cannot be expressed here; the message names every such key."""


def _merge(schema: Mapping[str, Any], given: Mapping[str, Any], prefix: str, unknown: list[str]) -> dict[str, Any]:
    """SkyRL's defaults overlaid with ``given``; keys SkyRL does not have go to ``unknown``."""
    out = dict(schema)
    for key, value in given.items():
        if key not in schema:
            unknown.append(f"{prefix}{key}")
        elif isinstance(schema[key], dict):
            if not isinstance(value, Mapping):
                unknown.append(f"{prefix}{key} (a section, got {value!r})")
                continue
            out[key] = _merge(schema[key], value, f"{prefix}{key}.", unknown)
        else:
            out[key] = value
    return out


def _section(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``trainer.algorithm`` section of a whole config, of a ``trainer`` section, or the section itself."""
    if "trainer" in data and isinstance(data["trainer"], Mapping):
        data = data["trainer"]
    if "algorithm" in data and isinstance(data["algorithm"], Mapping):
        data = data["algorithm"]
    return data


def _from_overrides(items: Sequence[str]) -> dict[str, Any]:
    import yaml  # PyYAML: a dependency of transformers, which this package requires

    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.lstrip("+").partition("=")
        if not sep:
            raise SkyRLConfigError(f"SkyRL override {item!r} must look like trainer.algorithm.key=value")
        parts = key.strip().split(".")
        if parts[:2] != ["trainer", "algorithm"] or len(parts) < 3:
            continue  # another section of the SkyRL config
        node = out
        for part in parts[2:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    return out


def _number(path: str, value: Any, errors: list[str]) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        errors.append(f"{path}={value!r} (a number is expected)")
        return 0.0
    return float(value)


def skyrl_sections(source: Mapping[str, Any] | str | Path | Sequence[str]) -> dict[str, dict[str, Any]]:
    """Our ``advantage``, ``loss`` and ``correction`` keys for a SkyRL algorithm section (see the module docstring
    for ``source``); raises :class:`SkyRLConfigError` naming every setting with no equivalent here."""
    if isinstance(source, (str, Path)):
        return load_skyrl_sections(source)
    given = _from_overrides(source) if not isinstance(source, Mapping) else _section(source)
    unknown: list[str] = []
    c = _merge(_SCHEMA, given, "", unknown)
    opc = c["off_policy_correction"]
    bad: list[str] = [f"{k} (not a SkyRL trainer.algorithm key)" for k in unknown]

    def no_equivalent(key: str, why: str) -> None:
        bad.append(f"{key}={c[key]!r} ({why})")

    adv: dict[str, Any] = {}
    if c["advantage_estimator"] == "grpo":
        adv["estimator"] = "grpo" if c["grpo_norm_by_std"] else "dr_grpo"
    elif c["advantage_estimator"] == "rloo":
        adv["estimator"] = "rloo"
    else:
        no_equivalent("advantage_estimator", "estimators here: grpo, grpo without std (dr_grpo), rloo")
    if c["advantage_batch_normalize"]:
        no_equivalent("advantage_batch_normalize", "no batch-level advantage normalisation here")
    if c["zero_variance_filter"]:
        no_equivalent("zero_variance_filter", "zero-variance groups get advantage 0 here, they are not masked")
    if c["dynamic_sampling"]["type"] is not None:
        bad.append(f"dynamic_sampling.type={c['dynamic_sampling']['type']!r} (no dynamic sampling here)")
    if c["use_kl_in_reward"]:
        no_equivalent("use_kl_in_reward", "a KL penalty goes in the loss here (use_kl_loss)")
    if c["temperature"] is not None:
        no_equivalent("temperature", "not an algorithm setting here: it is sampling.temperature of the learner")

    loss: dict[str, Any] = {}
    ptype = c["policy_loss_type"]
    if ptype in _LOSSES:
        loss["type"] = _LOSSES[ptype]
    else:
        no_equivalent("policy_loss_type", f"losses here: {', '.join(_LOSSES)}")
    if ptype in ("regular", "dual_clip", "rollout_is"):
        loss["clip_eps_low"] = _number("eps_clip_low", c["eps_clip_low"], bad)
        loss["clip_eps_high"] = _number("eps_clip_high", c["eps_clip_high"], bad)
    if ptype == "dual_clip":
        loss["dual_clip"] = _number("clip_ratio_c", c["clip_ratio_c"], bad)
    if ptype == "cispo":
        cispo = c["cispo"]
        loss["cispo_anchor"] = cispo["cispo_anchor"]
        loss["cispo_eps_clip_low"] = _number("cispo.cispo_eps_clip_low", cispo["cispo_eps_clip_low"], bad)
        loss["cispo_eps_clip_high"] = _number("cispo.cispo_eps_clip_high", cispo["cispo_eps_clip_high"], bad)
    reduction = c["loss_reduction"]
    if reduction in _REDUCTIONS:
        loss["reduction"] = _REDUCTIONS[reduction]
    else:
        no_equivalent("loss_reduction", f"reductions here: {', '.join(_REDUCTIONS)}")
    if reduction == "seq_mean_token_sum_norm":
        if c["max_seq_len"] is None:
            bad.append("max_seq_len=None (SkyRL requires it with loss_reduction='seq_mean_token_sum_norm')")
        else:
            loss["max_tokens"] = int(_number("max_seq_len", c["max_seq_len"], bad))
    if c["use_kl_loss"]:
        loss["kl_coef"] = _number("kl_loss_coef", c["kl_loss_coef"], bad)
        if c["kl_estimator_type"] in ("k1", "k2", "k3"):
            loss["kl_estimator"] = c["kl_estimator_type"]
        else:
            no_equivalent("kl_estimator_type", "estimators here: k1, k2, k3")
    if c["use_entropy_loss"]:
        loss["entropy_coef"] = _number("entropy_loss_coef", c["entropy_loss_coef"], bad)

    corr: dict[str, Any] = {"anchor": "old"}
    tis = opc["tis_ratio_type"]
    if c["use_tis"]:  # SkyRL's deprecated switch, translated as SkyRL's validation does it
        tis, opc = "token", {**opc, "token_tis_ratio_clip_high": c["tis_imp_ratio_cap"]}
    if tis in ("token", "sequence"):
        corr["tis"] = tis
        cap_key = f"{tis}_tis_ratio_clip_high"
        corr[f"{tis}_tis_cap"] = _number(f"off_policy_correction.{cap_key}", opc[cap_key], bad)
    elif tis is not None:
        bad.append(f"off_policy_correction.tis_ratio_type={tis!r} (SkyRL accepts None, 'token', 'sequence')")
    seq = opc["sequence_mask_metric"]
    if seq in ("geometric", "product"):
        corr["sequence_mask"] = seq
        short = "geo" if seq == "geometric" else "product"
        for side in ("low", "high"):
            key = f"{short}_mask_{side}"
            corr[f"{seq}_{side}"] = _number(f"off_policy_correction.{key}", opc[key], bad)
    elif seq is not None:
        bad.append(f"off_policy_correction.sequence_mask_metric={seq!r} (SkyRL accepts None, 'product', 'geometric')")
    for ours, theirs in (("outlier", "outlier_token_is_threshold"), ("token_mask", "token_mask_is_threshold")):
        low, high = opc[f"{theirs}_low"], opc[f"{theirs}_high"]
        if low is not None or high is not None:  # a one-sided token mask stays off, as in SkyRL (our config warns)
            corr["outlier_mask" if ours == "outlier" else "token_mask"] = True
            for side, value in (("low", low), ("high", high)):
                key = f"off_policy_correction.{theirs}_{side}"
                corr[f"{ours}_{side}"] = None if value is None else _number(key, value, bad)

    if bad:
        raise SkyRLConfigError(
            "SkyRL trainer.algorithm settings with no equivalent here (see docs/algorithms.md, 'From SkyRL'): "
            + "; ".join(bad)
        )
    return {"advantage": adv, "loss": loss, "correction": corr}


def load_skyrl_sections(path: str | Path) -> dict[str, dict[str, Any]]:
    """:func:`skyrl_sections` of a YAML file (a whole SkyRL config or a part, see the module docstring)."""
    import yaml  # PyYAML: a dependency of transformers, which this package requires

    p = Path(path)
    if not p.is_file():
        raise SkyRLConfigError(f"algorithm.from_skyrl: {p} is not a file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise SkyRLConfigError(f"algorithm.from_skyrl: {p} is not valid YAML: {exc}") from exc
    if not isinstance(data, Mapping):
        raise SkyRLConfigError(f"algorithm.from_skyrl: {p} must hold a mapping, got {type(data).__name__}")
    return skyrl_sections(data)
