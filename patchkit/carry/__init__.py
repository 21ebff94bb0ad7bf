"""The pipeline that carries the patch: pin -> source -> render -> commit -> patches -> build."""
