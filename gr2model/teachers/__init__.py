"""The teachers of the `traces` stage: stronger re-rankers that write GR2's reasoning traces.

`teacher` holds the teacher protocol, the expert teacher with its features and the
trace writers (targeted prompting and rejection sampling); `ltr_teacher` the
LightGBM lambdarank teacher and the per-candidate evidence it computes.
"""
