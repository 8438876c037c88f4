"""Trains one config under one precision policy.

  python -m experiments.main --config=experiments/configs/cpu.py --workdir=/tmp/jaxmp_run
  python -m experiments.main --config=gpu_t4 --config.policy=O2-fp16 --workdir=...

Started again with the same --workdir, a run resumes from its newest intact checkpoint.
Metrics: tensorboard --logdir=<workdir>. To compare policies: python -m experiments.compare.
"""

from absl import flags, logging

from experiments import cli

cli.define_flags()
FLAGS = flags.FLAGS


def main(argv):
    del argv  # cli.run rejects extra arguments
    from experiments import train  # after flag parsing: keeps --help fast

    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
    result = train.train_and_evaluate(FLAGS.config, FLAGS.workdir, report=FLAGS.report)
    print(train.summary_line(result))


if __name__ == "__main__":
    cli.run(main)
