"""Plain LoRA (Hu et al. 2021, https://arxiv.org/abs/2106.09685): W x + (alpha / r) B A x, all of it
`AdapterVariant`'s defaults."""

from litsft.model.lora.variants.spec import AdapterVariant

VARIANT = AdapterVariant()
