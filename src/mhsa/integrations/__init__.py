"""mhsa inside other libraries' models: transformers' attn_implementation="mhsa"
(integrations/transformers), timm's attention layers (integrations/timm) and
FlexAttention's own API (integrations/flex, public as mhsa.flex). Each module imports
its library only when used."""
