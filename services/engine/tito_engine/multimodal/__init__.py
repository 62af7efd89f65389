"""Media items: admission of MultiModalFeatures, the vision encoders and the encoder cache."""
