"""config.py: the training config composes each component's settings; the one flag table; every
choice comes from its one registry; the checks across components; derived values."""

import pytest

from llama_ddp.attention_plan.backends import ORDER
from llama_ddp.distributed.parallelize import MODES
from llama_ddp.errors import UserError
from llama_ddp.model.config import PRESETS
from llama_ddp.precision import DTYPES
from llama_ddp.settings import literal_choices
from llama_ddp.train.config import FLAGS, TrainConfig
from llama_ddp.train.metrics import SINKS
from llama_ddp.train.optim import OPTIMIZERS, SCHEDULES, ScheduleSettings

# Every setting as the flat TrainConfig had it before the components (issue 41): the flags, the
# keys of a TOML file and the run config the loggers record, in --help's order of then.
FLAT_SETTINGS = """init_from preset hidden_size intermediate_size num_hidden_layers
num_attention_heads num_key_value_heads max_position_embeddings rope_theta tie_embeddings dataset
dataset_weights sources dataset_config split text_column streaming val_fraction tokenizer
vocab_size bot_token eot_token pad_token seq_length packing document_mask cache_dir num_workers
num_proc batch_size micro_batch_size epochs max_steps optimizer lr min_lr warmup_steps lr_schedule
decay_fraction weight_decay beta1 beta2 grad_clip mode device dtype compile
activation_checkpointing seed out_dir save_every keep_last resume eval_every eval_tokens
eval_tasks eval_limit log_every log_to profile_steps peak_tflops export_hf export_gguf""".split()
SETTINGS_SINCE = ["time_budget", "attention", "model_size"]  # issues 46, 45, 54


def test_the_flag_table_holds_every_setting_of_before_once():
    assert sorted(FLAGS) == sorted(FLAT_SETTINGS + SETTINGS_SINCE)
    assert {flag.component for flag in FLAGS.values()} == set(vars(TrainConfig()))


def test_a_config_is_made_from_and_read_as_flat_settings():
    cfg = TrainConfig.from_flags(seq_length=64, lr=3e-4, mode="ddp", keep_last=5, eval_limit=9)
    assert (cfg.data.seq_length, cfg.optim.lr, cfg.runtime.mode) == (64, 3e-4, "ddp")
    assert (cfg.checkpoint.keep_last, cfg.eval.eval_limit) == (5, 9)
    flat = cfg.flags()  # what the loggers record as the run's config, as before the components
    assert list(flat) == list(FLAGS) and sorted(flat) == sorted(FLAT_SETTINGS + SETTINGS_SINCE)
    assert (flat["seq_length"], flat["lr"], flat["batch_size"]) == (64, 3e-4, 32)
    assert TrainConfig.from_flags(**flat) == cfg
    with pytest.raises(TypeError, match="no setting seq_len"):
        TrainConfig.from_flags(seq_len=64)


def test_each_choice_is_its_registry():
    def choices(name):
        return literal_choices(FLAGS[name].hint)

    assert choices("lr_schedule") == tuple(SCHEDULES)
    assert choices("mode") == ("auto", *MODES)
    assert choices("dtype") == ("auto", *DTYPES)
    assert choices("preset") == tuple(PRESETS)
    assert choices("optimizer") == tuple(OPTIMIZERS)
    assert choices("attention") == ("auto", *ORDER)
    help_of = {name: flag.field.metadata["help"] for name, flag in FLAGS.items()}
    assert all(name in help_of["lr_schedule"] for name in SCHEDULES)
    assert all(name in help_of["mode"] for name in MODES)
    assert all(name in help_of["log_to"] for name in SINKS)
    assert all(name in help_of["optimizer"] for name in OPTIMIZERS)


def test_a_logger_is_checked_against_the_registry():
    with pytest.raises(UserError, match="--log-to 'csv' is not one of: tensorboard, wandb"):
        TrainConfig.from_flags(log_to="csv").validate()
    assert TrainConfig.from_flags(log_to="tensorboard, none").output.loggers() == ["tensorboard"]


def test_default_warmup():
    schedule = ScheduleSettings()
    assert schedule.warmup(10_000) == 100
    assert schedule.warmup(200) == 20
    assert schedule.warmup(5) == 1
    assert ScheduleSettings(warmup_steps=0).warmup(10_000) == 0


def test_the_checks_across_components():
    """The peak lr (optimizer) against --min-lr (schedule), the shape (model) against
    --seq-length (data), --init-from (model) against --tokenizer auto (data)."""
    with pytest.raises(UserError, match=r"need 0 <= --min-lr <= --lr .* \(got 0.01, 0.004\)"):
        TrainConfig.from_flags(min_lr=1e-2).validate()
    with pytest.raises(UserError, match="--seq-length 4096 exceeds the model's .* 2048"):
        TrainConfig.from_flags(seq_length=4096, preset="base").validate()
    TrainConfig.from_flags(seq_length=4096, max_position_embeddings=4096).validate()
    with pytest.raises(UserError, match="--init-from needs the tokenizer its model was trained"):
        TrainConfig.from_flags(init_from="some/model").validate()


def test_the_optimizer_and_its_lr_are_settled_before_the_run_starts():
    """Muon by default, in every mode (FSDP too); AdamW for --init-from (the optimizer an open
    model was trained with); the checkpoint's when a run resumes; each with its own default lr
    unless --lr is given."""

    def settled(cfg, saved=None):
        optim = cfg.settle(saved_optimizer=saved).optim
        return optim.optimizer, optim.lr

    assert settled(TrainConfig().validate()) == ("muon", OPTIMIZERS["muon"].lr) == ("muon", 4e-3)
    assert settled(TrainConfig.from_flags(mode="fsdp").validate()) == ("muon", 4e-3)
    continued = TrainConfig.from_flags(init_from="some/model", tokenizer="some/model")
    assert settled(continued) == ("adamw", 1e-3)
    told_muon = TrainConfig.from_flags(init_from="some/model", optimizer="muon")
    assert settled(told_muon) == ("muon", 4e-3)
    assert settled(TrainConfig().validate(), "adamw") == ("adamw", 1e-3)
    told = TrainConfig.from_flags(optimizer="adamw", lr=3e-4).validate().settle("muon")
    assert (told.optim.optimizer, told.optim.lr) == ("adamw", 3e-4)  # a resume: refused later
    assert told.settle() == told  # settled once and for all
    assert settled(TrainConfig.from_flags(mode="fsdp").validate(), "muon") == ("muon", 4e-3)
    with pytest.raises(UserError, match=r"need 0 <= --min-lr <= --lr .* \(got 0.002, 0.001\)"):
        TrainConfig.from_flags(min_lr=2e-3).validate().settle(saved_optimizer="adamw")
