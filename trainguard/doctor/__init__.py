"""Pre-flight checks that run a model before a long training job.

Each check leaves the caller's model, optimizer and RNG state exactly as it found them and
returns a result object with ``passed`` (where a verdict applies), ``findings()``, ``to_dict()``
and a rich rendering::

    from trainguard import doctor

    doctor.overfit_one_batch(model, (x, y), loss_fn).reason     # None, or nan/flat/unstable/slow/floor
    doctor.lr_range_test(model, loader, loss_fn).suggestion     # steepest descent of the smoothed loss
    doctor.gradient_check(model, (x, y), loss_fn).bad_params    # parameters whose gradients are wrong
    doctor.validate_data((x_train, y_train), (x_test, y_test))  # NaN, duplicates, leakage, imbalance ...
    doctor.init_checks(model, (x, y), loss_fn)                  # shapes, initial loss vs ln C, counts
    doctor.run_checklist(model, loader, loss_fn).save("runs/doctor")
"""

from trainguard.doctor._checklist import CHECKS, CheckError, DoctorReport, DoctorSetup, run_checklist
from trainguard.doctor._data import DataReport, validate_data
from trainguard.doctor._gradcheck import GradCheckResult, ParamCheck, gradient_check
from trainguard.doctor._init_checks import InitReport, init_checks
from trainguard.doctor._lr_range import LRRangeResult, lr_range_test
from trainguard.doctor._overfit import OverfitResult, overfit_one_batch
from trainguard.doctor._results import CheckResult
from trainguard.doctor._state import DoctorInputError, preserved

__all__ = [
    "CHECKS",
    "CheckError",
    "CheckResult",
    "DataReport",
    "DoctorInputError",
    "DoctorReport",
    "DoctorSetup",
    "GradCheckResult",
    "InitReport",
    "LRRangeResult",
    "OverfitResult",
    "ParamCheck",
    "gradient_check",
    "init_checks",
    "lr_range_test",
    "overfit_one_batch",
    "preserved",
    "run_checklist",
    "validate_data",
]
