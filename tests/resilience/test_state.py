"""TrainState: what it accepts, wraps and keeps per rank."""

from __future__ import annotations

import sys
import warnings

import dp_models
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainguard import CheckpointError
from trainguard.resilience import CheckpointManager, ResumableLoader, TrainState
from trainguard.resilience._state import RNG


def loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(10.0)), batch_size=2, shuffle=True)


def test_plain_loader_is_wrapped_and_objects_are_attributes():
    model = torch.nn.Linear(2, 2)
    gen = torch.Generator().manual_seed(0)
    state = TrainState(model=model, loader=loader(), gen=gen)
    assert state.model is model and state.gen is gen
    assert isinstance(state.loader, ResumableLoader)
    assert state.names() == ["model", "loader", "gen"]
    assert state.is_rank_local("loader") and state.is_rank_local("gen") and not state.is_rank_local("model")
    assert (state.step, state.epoch) == (0, 0)
    with pytest.raises(AttributeError, match="holds model, loader, gen"):
        _ = state.optimizer


@pytest.mark.parametrize("name", ["step", "epoch", "rng", "_private", "capture", "names"])
def test_reserved_names_are_refused(name):
    with pytest.raises(ValueError, match="reserved"):
        TrainState(**{name: torch.nn.Linear(1, 1)})


def test_objects_without_state_dict_are_refused():
    with pytest.raises(TypeError, match=r"TrainState\(lr=\.\.\.\) needs an object with state_dict"):
        TrainState(lr=0.1)


def test_a_list_of_optimizers_is_refused_with_how_to_pass_them():
    # KellerJordan/Muon beside AdamW (Muon for the hidden matrices, AdamW for the embeddings), kept
    # as `optimizers = [muon, adamw]` as modded-nanogpt does: TrainState(optimizer=optimizers) said
    # only "needs an object with state_dict() and load_state_dict() ..., got list".
    model = torch.nn.Linear(2, 2)
    opts = [torch.optim.SGD([model.weight], lr=0.1), torch.optim.AdamW([model.bias], lr=0.1)]
    with pytest.raises(TypeError, match=r"got list of 2 SGD, AdamW: pass each under a name of its own, "
                                        r"TrainState\(optimizer0=\.\.\., optimizer1=\.\.\.\)"):
        TrainState(model=model, optimizer=opts)


def test_an_object_assigned_after_construction_is_held_like_one_passed_to_it():
    # cleanrl's ppo.py (vwxyzjn/cleanrl, cleanrl/ppo.py) made resumable: each iteration collects a
    # new rollout and sets `state.loader = DataLoader(TensorDataset(b_obs, ...), shuffle=True)`. The
    # assignment made a plain attribute that checkpoints never saved and batches() never saw
    # ("pass loader=... to TrainState"), and a model assigned anew was saved as the old one.
    state = TrainState(model=torch.nn.Linear(2, 2))
    state.loader = loader()
    assert isinstance(state.loader, ResumableLoader) and state.names() == ["model", "loader"]
    assert state.is_rank_local("loader") and set(state.capture().local) == {"loader", RNG}
    new = torch.nn.Linear(2, 2)
    state.model = new
    assert state.model is new and torch.equal(state.capture().shared["model"]["weight"], new.weight)
    with pytest.raises(TypeError, match=r"TrainState\(lr=\.\.\.\) needs an object with state_dict"):
        state.lr = 0.1
    with pytest.raises(ValueError, match="reserved"):
        state.rng = torch.Generator()
    state.step, state.epoch = 3, 1  # trainguard's counters stay plain
    assert (state.step, state.epoch) == (3, 1) and state.names() == ["model", "loader"]


def test_capture_splits_shared_and_per_rank_state_and_apply_restores_rng_last():
    state = TrainState(model=torch.nn.Linear(2, 2), loader=loader())
    cap = state.capture()
    assert set(cap.shared) == {"model"} and set(cap.local) == {"loader", RNG}
    before = torch.rand(3)
    state.apply({"model": cap.shared["model"]}, cap.local, step=5, epoch=2)
    assert torch.equal(torch.rand(3), before)
    assert (state.step, state.epoch) == (5, 2)


def test_a_failing_load_names_the_object():
    state = TrainState(model=torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="cannot restore 'model'"):
        state.apply({"model": {"weight": torch.zeros(2, 2)}}, None, step=0, epoch=0)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata's own, not ours
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stateful_dataloader_is_used_as_is_and_resumes_exactly(tmp_path, num_workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from trainguard.resilience import CheckpointManager

    from .conftest import assert_same_training_state, make_state, train_steps

    reference = make_state(stateful_loader=True, num_workers=num_workers)
    assert isinstance(reference.loader, StatefulDataLoader) and reference.is_rank_local("loader")
    expected = train_steps(reference, 13)
    first = make_state(stateful_loader=True, num_workers=num_workers)
    losses = train_steps(first, 7)
    CheckpointManager(tmp_path).save(first)
    resumed = make_state(seed=5, stateful_loader=True, num_workers=num_workers)
    assert CheckpointManager(tmp_path).restore(resumed) == 7
    losses += train_steps(resumed, 6)
    assert losses == expected
    assert_same_training_state(reference, resumed)


def accelerate_prepare(model, opt, sched, loader):
    from accelerate import Accelerator

    return Accelerator(cpu=True).prepare(model, opt, sched, loader)


def accelerate_prepare_seedable(model, opt, sched, loader):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    # accelerate's SeedableRandomSampler makes its generator at its first __iter__ and seeds it
    # from torch.initial_seed() + its epoch
    config = DataLoaderConfiguration(use_seedable_sampler=True)
    return Accelerator(cpu=True, dataloader_config=config).prepare(model, opt, sched, loader)


def fabric_setup(model, opt, sched, loader):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model, opt = fabric.setup(model, opt)
    return model, opt, sched, fabric.setup_dataloaders(loader)


@pytest.fixture
def fresh_accelerate():
    yield
    if "accelerate" in sys.modules:  # its state is process-wide: leave none to later tests
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.mark.parametrize("prepare", [accelerate_prepare, accelerate_prepare_seedable, fabric_setup],
                         ids=["accelerate", "accelerate-seedable-sampler", "fabric"])
def test_a_loader_a_framework_prepared_resumes_mid_epoch_exactly(tmp_path, prepare, fresh_accelerate):
    # What a user of accelerate (examples/nlp_example.py: accelerator.prepare(model, optimizer,
    # train_dataloader, ...)) or of Fabric (fabric.setup, fabric.setup_dataloaders) passes to
    # TrainState: accelerate's DataLoaderShard has a state_dict() that fails unless it was made
    # with use_stateful_dataloader=True (the first save raised); Fabric's loader was refused.
    pytest.importorskip("lightning" if prepare is fabric_setup else "accelerate")
    from trainguard.resilience import CheckpointManager

    from .conftest import assert_same_training_state, make_state, train_steps

    reference = make_state(prepare=prepare)
    expected = train_steps(reference, 13)
    first = make_state(prepare=prepare)
    assert first.is_rank_local("loader")
    losses = train_steps(first, 7)  # 5 batches an epoch: in the middle of the second
    CheckpointManager(tmp_path).save(first)
    resumed = make_state(seed=5, prepare=prepare)
    assert CheckpointManager(tmp_path).restore(resumed) == 7
    losses += train_steps(resumed, 6)
    assert losses == expected
    assert_same_training_state(reference, resumed)


@pytest.mark.parametrize("save_as, load_as", [("compiled", "plain"), ("plain", "compiled"),
                                              ("data_parallel", "compiled"), ("plain", "data_parallel"),
                                              ("grad_sample", "plain"), ("plain", "grad_sample")])
def test_a_checkpoint_fits_the_model_compiled_or_not_wrapped_or_not(tmp_path, save_as, load_as):
    # nanoGPT trains with compile=True and evaluates or resumes with compile=False: a compiled
    # model's state_dict names every key "_orig_mod.<key>" (DataParallel and DDP "module.<key>"),
    # and the checkpoint "does not fit" the same model unwrapped.
    from trainguard.resilience import CheckpointManager

    def make(how):
        torch.manual_seed(0 if how == save_as else 1)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
        # opacus' make_private wraps the model in a GradSampleModule ("_module.<key>"): a model
        # trained with differential privacy is evaluated or fine-tuned without it.
        wrapped = {"plain": model, "compiled": torch.compile(model),
                   "data_parallel": torch.nn.DataParallel(model),
                   "grad_sample": dp_models.GradSampleModule(model)}[how]
        return model, TrainState(model=wrapped, optimizer=torch.optim.Adam(model.parameters()))

    model, state = make(save_as)
    model(torch.ones(1, 4)).sum().backward()  # the module itself: no compilation needed here
    state.optimizer.step()
    CheckpointManager(tmp_path / "ck").save(state)
    other, restored = make(load_as)
    assert not torch.equal(other[0].weight, model[0].weight)
    CheckpointManager(tmp_path / "ck").restore(restored)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values()))
    moments = [s.optimizer.state_dict()["state"][0]["exp_avg"] for s in (state, restored)]
    assert moments[0].equal(moments[1])
    assert state.model is not model or save_as == "plain"  # the user's object is what they gave


def test_optimizer_moments_a_fresh_optimizer_creates_on_restore_keep_the_saved_memory_layout(tmp_path):
    # timm's train.py --channels-last with LAMB (timm/optim/lamb.py): the moments are zeros_like of
    # channels_last conv weights. Restored into plain contiguous buffers, LAMB's norms summed in
    # another order and a run resumed after kill -9 drifted from the uninterrupted one at the second
    # step after the restore (EMA sums 1939.9548027967728 against 1939.9548024622507).
    from trainguard import CheckpointManager

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2))
        model(torch.randn(1, 3, 6, 6))
        model = model.to(memory_format=torch.channels_last)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(model, opt):
        model(torch.randn(4, 3, 6, 6).contiguous(memory_format=torch.channels_last)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    model, opt = make()
    step(model, opt)
    ckpt = CheckpointManager(tmp_path / "ck")
    ckpt.save(TrainState(model=model, optimizer=opt), step=1)
    model2, opt2 = make()
    ckpt.restore(TrainState(model=model2, optimizer=opt2))
    w, w2 = model[0].weight, model2[0].weight
    for k in ("exp_avg", "exp_avg_sq"):
        assert opt2.state[w2][k].stride() == opt.state[w][k].stride() == w.stride(), k
        assert torch.equal(opt2.state[w2][k], opt.state[w][k])
    assert opt2.state[model2[2].weight]["exp_avg"].is_contiguous()


class _Task(torch.nn.Module):
    """A training task holding the model, as open_clip's TrainingTask (mlfoundations/open_clip,
    src/open_clip/task/base_task.py): its own ``state_dict()`` nests the model's under
    ``"state_dict"``, and its ``load_state_dict`` loads the model's and returns None."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.trainable_module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        self.trainable_module.logit_scale = torch.nn.Parameter(torch.tensor(2.6592))

    def state_dict(self, *args, **kwargs) -> dict:
        return {"state_dict": self.trainable_module.state_dict()}

    def load_state_dict(self, state_dict: dict, strict: bool = True, **kwargs):
        if "state_dict" in state_dict:
            self.trainable_module.load_state_dict(state_dict["state_dict"], strict=strict)


def test_a_module_whose_load_state_dict_returns_none_is_restored(tmp_path):
    # open_clip's main.py with TrainState(model=task, ...): the resume after kill -9 failed with
    # "cannot restore 'model': AttributeError: 'NoneType' object has no attribute 'unexpected_keys'".
    from trainguard.resilience import CheckpointManager

    saved = _Task(0)
    CheckpointManager(tmp_path / "ck").save(TrainState(model=saved))
    task = _Task(1)
    assert not torch.equal(task.trainable_module[0].weight, saved.trainable_module[0].weight)
    CheckpointManager(tmp_path / "ck").restore(TrainState(model=task))
    assert all(torch.equal(a, b) for a, b in zip(task.trainable_module.state_dict().values(),
                                                 saved.trainable_module.state_dict().values()))


class _AutoGuide(torch.nn.Module):
    """pyro's AutoNormal (pyro-ppl/pyro, pyro/infer/autoguide/guides.py): its ``locs`` and
    ``scales`` are made on the guide's first call (``_setup_prototype``), so a guide built afresh
    to resume has no parameters yet."""

    def forward(self, x):
        if not hasattr(self, "locs"):
            self.locs = torch.nn.Parameter(torch.zeros(x.shape[1]))
            self.scales = torch.nn.Parameter(torch.ones(x.shape[1]))
        return self.locs + self.scales * x


def test_a_module_that_makes_its_parameters_on_its_first_call_is_told_to_be_called_before_restoring(tmp_path):
    # pyro's Bayesian regression tutorial with TrainState(guide=AutoNormal(model), ...): the resumed
    # run said only "the checkpoint has keys 'guide' lacks (unexpected): locs..., scales...".
    from trainguard.resilience import CheckpointManager

    guide = _AutoGuide()
    guide(torch.ones(2, 3))
    CheckpointManager(tmp_path / "ck").save(TrainState(guide=guide))
    with pytest.raises(CheckpointError, match="unexpected") as err:
        CheckpointManager(tmp_path / "ck").restore(TrainState(guide=_AutoGuide()))
    assert "'guide' has no parameters or buffers yet" in str(err.value), err.value
    assert "first call" in str(err.value) and "guide(" in str(err.value), err.value


class _PyroOptim:
    """pyro.optim's PyroOptim (pyro-ppl/pyro, pyro/optim/optim.py): its state by parameter name
    through get_state()/set_state(), no state_dict()."""

    def get_state(self):
        return {}

    def set_state(self, state):
        pass


def test_an_optimizer_with_get_state_and_set_state_is_refused_with_the_adapter_to_write():
    # pyro's VAE (examples/vae/vae.py) with TrainState(model=vae, optimizer=pyro.optim.Adam(...)): the
    # error said what is missing and not that the object's get_state()/set_state() are the way to it.
    with pytest.raises(TypeError, match="got _PyroOptim") as err:
        TrainState(optimizer=_PyroOptim())
    assert "get_state()" in str(err.value) and "set_state(" in str(err.value), err.value
    assert "integrations.md" in str(err.value), err.value


class ShadowEMA:
    """The shape of diffusers' ``training_utils.EMAModel`` (train_unconditional.py --use_ema): a
    plain object, not a module, holding a shadow copy of the parameters that ``step()`` moves after
    each optimizer step, with its own ``state_dict()`` / ``load_state_dict()``."""

    def __init__(self, parameters, decay: float = 0.9):
        self.shadow_params = [p.detach().clone() for p in parameters]
        self.decay, self.optimization_step = decay, 0

    @torch.no_grad()
    def step(self, parameters) -> None:
        self.optimization_step += 1
        for s, p in zip(self.shadow_params, parameters):
            s.sub_((1 - self.decay) * (s - p))

    def state_dict(self) -> dict:
        return {"decay": self.decay, "optimization_step": self.optimization_step,
                "shadow_params": self.shadow_params}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.optimization_step = state["decay"], state["optimization_step"]
        self.shadow_params = [t.clone() for t in state["shadow_params"]]


def _messages(caught) -> list[str]:
    return [str(w.message) for w in caught if "TrainState" in str(w.message)]


def test_resume_warns_about_an_object_with_state_the_caller_left_out_of_the_train_state(tmp_path):
    # diffusers' train_unconditional.py --use_ema: TrainState(model, optimizer, scheduler, loader)
    # without the EMAModel resumed with the EMA restarted (20 of 30 EMA steps, other weights) and,
    # under the guard, kept the NaN weights of the rewound step, silently
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    ema = ShadowEMA(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CheckpointManager(tmp_path / "ckpt").resume(TrainState(model=model, optimizer=opt), total_steps=1)
    [message] = _messages(caught)
    assert "ema (ShadowEMA)" in message and "not in the TrainState" in message
    assert "TrainState(..., ema=ema)" in message and "rewind" in message
    assert caught[0].filename == __file__  # points at the resume() line
    ema.step(model.parameters())


def test_resume_does_not_warn_about_objects_it_holds_or_that_hold_no_training_state(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    ema = ShadowEMA(model.parameters())
    same_model = model                                       # unwrap_model(model)
    loss_fn = torch.nn.MSELoss()                              # a module without parameters
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)      # a frozen VAE or text encoder
    scaler = torch.amp.GradScaler("cpu", enabled=False)       # disabled: nothing to save
    model_class = torch.nn.Linear                             # a class has state_dict too
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CheckpointManager(tmp_path / "ckpt").resume(TrainState(model=model, optimizer=opt, ema=ema), total_steps=1)
    assert _messages(caught) == []
    del same_model, loss_fn, frozen, scaler, model_class


class _DINOLoss(torch.nn.Module):
    """facebookresearch/dino @ 7c446df5, main_dino.py DINOLoss: no parameters, a ``center`` buffer
    moved every step (reassigned, as update_center does)."""

    def __init__(self, out_dim):
        super().__init__()
        self.register_buffer("center", torch.zeros(1, out_dim))

    def forward(self, student_output, teacher_output):
        q = torch.softmax((teacher_output - self.center) / 0.04, dim=-1).detach()
        loss = torch.sum(-q * torch.log_softmax(student_output / 0.1, dim=-1), dim=-1).mean()
        with torch.no_grad():
            self.center = self.center * 0.9 + teacher_output.mean(0, keepdim=True) * 0.1
        return loss


def test_resume_warns_when_a_module_without_trainable_parameters_left_out_moves(tmp_path):
    # main_dino.py's teacher (requires_grad=False, the EMA of the student under no_grad) and its
    # DINOLoss' center left out of TrainState(model=student, ...): the resumed run restarted the
    # teacher from the student's initial weights and the center from 0, and nothing said so, as
    # modules without trainable parameters (a frozen VAE) are never named.
    torch.manual_seed(0)
    student = torch.nn.Linear(4, 8)
    teacher = torch.nn.Linear(4, 8)
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    dino_loss = _DINOLoss(8)
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)  # a frozen encoder nothing moves: no warning
    opt = torch.optim.AdamW(student.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = CheckpointManager(tmp_path / "ckpt", every_steps=2).resume(
            TrainState(model=student, optimizer=opt), total_steps=4)
        assert _messages(caught) == []  # nothing moved yet: a frozen teacher would be no state
        for _ in loop:
            x = frozen(torch.randn(16, 4))
            loss = dino_loss(student(x), teacher(x))
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for ps, pt in zip(student.parameters(), teacher.parameters()):
                    pt.data.mul_(0.99).add_(0.01 * ps.detach().data)
    messages = _messages(caught)
    assert len(messages) == 2, messages  # once each, at the first save after they moved
    assert "teacher (Linear)" in messages[0] and "TrainState(..., teacher=teacher)" in messages[0], messages
    assert "dino_loss (_DINOLoss)" in messages[1] and "center" in messages[1], messages
    assert all(w.filename == __file__ for w in caught if "TrainState" in str(w.message))


def test_resume_does_not_warn_about_the_object_a_held_wrapper_holds(tmp_path):
    class Wrapped:  # accelerate's AcceleratedOptimizer holds the optimizer it wraps
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def state_dict(self):
            return self.optimizer.state_dict()

        def load_state_dict(self, state):
            self.optimizer.load_state_dict(state)

    model = torch.nn.Linear(3, 2)
    raw = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CheckpointManager(tmp_path / "ckpt").resume(TrainState(model=model, optimizer=Wrapped(raw)), total_steps=1)
    assert _messages(caught) == []


class _KerasAdam:
    """A Keras 3 optimizer (keras-team/keras, keras/src/optimizers/base_optimizer.py): its slots,
    iteration count and learning rate are Keras Variables in ``variables``, no state_dict()."""

    __module__ = "keras.src.optimizers.adam"

    variables: list = []

    def apply(self, grads, trainable_variables=None):
        pass


def test_a_keras_optimizer_is_refused_with_what_to_do():
    # TrainState(model=model, optimizer=model.optimizer) after model.compile on KERAS_BACKEND=torch:
    # the error said only that state_dict() was missing.
    with pytest.raises(TypeError, match="got _KerasAdam") as err:
        TrainState(optimizer=_KerasAdam())
    msg = str(err.value)
    assert "Keras optimizer" in msg and "torch.optim" in msg and "BackupAndRestore" in msg, msg
    assert "integrations.md#keras" in msg, msg


def test_an_algorithm_object_without_state_dict_is_refused_naming_the_torch_state_inside_it():
    # stable-baselines3 @ e05d2dbe (stable_baselines3/dqn/dqn.py, sac/sac.py): the algorithm a user
    # holds (`model = DQN(...)`) has no state_dict(); its torch state is model.policy (which holds the
    # target network too) and model.policy.optimizer, SAC's model.policy.actor.optimizer,
    # model.policy.critic.optimizer, log_ent_coef and ent_coef_optimizer; its replay buffer is NumPy
    # arrays. TrainState(model=model) said only "needs an object with state_dict() ..., got DQN".
    import numpy as np

    nn = torch.nn

    class Policy(nn.Module):
        def __init__(self):
            super().__init__()
            self.actor, self.critic, self.critic_target = nn.Linear(3, 1), nn.Linear(4, 1), nn.Linear(4, 1)
            self.actor.optimizer = torch.optim.Adam(self.actor.parameters())
            self.critic.optimizer = torch.optim.Adam(self.critic.parameters())

    class ReplayBuffer:
        def __init__(self):
            self.observations, self.pos, self.full = np.zeros((8, 3), np.float32), 0, False

    class SAC:
        def __init__(self):
            self.policy = Policy()
            self.critic, self.critic_target = self.policy.critic, self.policy.critic_target  # aliases
            self.log_ent_coef = torch.zeros(1, requires_grad=True)
            self.ent_coef_optimizer = torch.optim.Adam([self.log_ent_coef])
            self.replay_buffer = ReplayBuffer()
            self.num_timesteps, self.learning_rate = 0, 3e-4

    with pytest.raises(TypeError) as e:
        TrainState(model=SAC())
    msg = str(e.value)
    assert ("TrainState(policy=model.policy, policy_actor_optimizer=model.policy.actor.optimizer, "
            "policy_critic_optimizer=model.policy.critic.optimizer, ent_coef_optimizer=model.ent_coef_optimizer, "
            "log_ent_coef=torch.nn.ParameterList([model.log_ent_coef]))") in msg, msg
    assert "replay_buffer (ReplayBuffer)" in msg and "not saved" in msg, msg
