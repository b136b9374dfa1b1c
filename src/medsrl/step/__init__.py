"""The phases of one RL step, as small parts the module orders: the step's rollouts
(``rollouts.py``), the no-grad scoring forward (``scoring.py``), the distributed update plan
(``schedule.py``), the PPO update loop (``update.py``) and the step's metrics (``metrics.py``)."""
