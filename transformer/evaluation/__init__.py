"""Evaluation: sacreBLEU scores, the reproduction report and the figures."""
