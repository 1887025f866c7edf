"""The command line's words turned into hookscope's objects: model specs, inputs, data, edits,
method arguments, option types and small values. Nothing here runs a model."""
