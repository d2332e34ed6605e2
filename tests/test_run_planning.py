"""The run's memory decisions on devices planning is not told about (``device.UntoldDevice``: a hard limit that
``device_memory`` does not see, as a GPU whose free memory moved after it was read): the whole run fits, validation
included, and a probe that runs out narrows the batch instead of collapsing it."""



from yolo_ckpt.autobatch import plan_batch
from yolo_ckpt.device import SimulatedDevice, UntoldDevice
from yolo_ckpt.measure import build_model, planned_copy

from support import TRAIN_ARGS

ARGS = {**TRAIN_ARGS, "epochs": 1, "imgsz": 160, "val": False}


def test_autobatch_on_an_untold_device_narrows_the_batch_to_what_the_told_device_plans():
    """``memory_budget`` far above the device: told the device, the probes stop at it and the batch is extrapolated
    from the largest step it holds; untold, the first jump runs out of memory, and the batch is narrowed between
    batch 1 and that failure, then extrapolated the same way: within 25% of the told plan (it fell back to batch 1,
    the last measured, before), and no probe passed the device."""
    model = build_model("yolo11n.yaml")
    budget, device = 2**30, 160 * 2**20
    with planned_copy(model, "all") as m:
        with SimulatedDevice(device) as gpu:
            gpu.track([*m.parameters(), *m.buffers()])
            told = plan_batch(m, 160, budget, 0.6)
        with UntoldDevice(device) as dev:
            dev.track([*m.parameters(), *m.buffers()])
            untold = plan_batch(m, 160, budget, 0.6)
    assert told.extrapolated and untold.extrapolated and max(told.points) > 1
    assert max(untold.points) > 1 and abs(untold.batch / told.batch - 1) <= 0.25, (told, untold)
    assert dev.peak <= device
